"""What a run leaves on disk: checkpoints (`checkpoint`), the output directory's files and
their formats (`outputs`), trackers (`tracking`), the run lock (`runlock`) and the build-once
publication every cache entry goes through (`build_once`)."""
