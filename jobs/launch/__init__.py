"""Starting a run: the check that a cluster answers at `--address` (`cluster_check`) and the
launch on Ray or without it (`on_ray`). The job's entry point is `jobs.finetune`."""
