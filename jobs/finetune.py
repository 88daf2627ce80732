"""`python -m jobs.finetune SPEC [section.field=value ...]`: run one fine-tuning job.

This is the entrypoint `ray job submit` uses: inside a Ray job it trains on that cluster,
elsewhere on an embedded local Ray. `--local` runs without Ray at all (one process, or
several under `torchrun`), which is how GPU benchmarks run on machines without Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from jobs import secrets
from jobs.errors import SpecError
from jobs.spec import absolutize, load_spec, one_line

if TYPE_CHECKING:
    from jobs.run.step_record import StepRecord
    from jobs.spec import JobSpec


def preflight(spec: JobSpec) -> None:
    """Checks that need the data files but not the model weights: run before anything is created."""
    from jobs.objectives import Objective
    from jobs.run.outputs import check_write_places

    check_write_places(spec)  # the data cache (written next) and an MLflow file store: not a system dir, writable
    # Every record is parsed and checked, the texts not kept (the memory of one record); data
    # checked before (same content hash) is not read again.
    Objective.of(spec).check_records(spec)
    if spec.data.packing:
        from jobs.memory import config_from_spec
        from jobs.model.loading import check_packing

        check_packing(config_from_spec(spec))
    check_lora_rank(spec)
    if spec.model.adapter:  # lora.* must describe the starting adapter; its files are regular files
        from jobs.model.loading import starting_adapter_config

        starting_adapter_config(spec)


def build_data(spec: JobSpec) -> None:
    """Build (or find) the spec's tokenized cache entry here, on the driver, before the output
    dir is claimed: every refusal of the data that needs the tokenizer (every record dropped, a
    chat template that is missing, raises or is not prefix-stable) is then one line with nothing
    created, and the workers map the published entry instead of building it (same key: the
    tokenizer `load_tokenizer` returns is the one the job loads). A refused build leaves no entry
    (`jobs.data.load_dataset`); a cache that cannot be written is one line too."""
    from jobs.data import data_cache_dir
    from jobs.data.sources import drop_kept
    from jobs.model.loading import load_tokenizer
    from jobs.objectives import Objective

    tokenizer = load_tokenizer(spec)
    try:
        Objective.of(spec).build_data(spec, tokenizer)
    except OSError as e:
        where = data_cache_dir(spec, "")
        raise SpecError(
            f"data.cache_dir={one_line(str(where))}: cannot write the tokenized data there "
            f"({one_line(e.strerror or str(e))}{': ' + one_line(str(e.filename)) if e.filename else ''})"
        ) from None
    finally:
        drop_kept()  # the data's last reader on the driver (`jobs.data.sources.read_once`)


def check_lora_rank(spec: JobSpec) -> None:
    """`lora.r` at most the model's hidden size (a rank above it adds nothing and can allocate
    without bound), where the model's config is here to read without a download."""
    from jobs.memory.config_io import config_from_spec, config_is_local

    if not config_is_local(spec):
        return

    hidden = getattr(config_from_spec(spec), "hidden_size", None)
    if isinstance(hidden, int) and spec.lora.r > hidden:
        raise SpecError(
            f"lora.r={spec.lora.r} exceeds the model's hidden size {hidden}: a LoRA rank above it adds nothing"
        )


def check_local_workers(spec: JobSpec, local: bool) -> None:
    """`--local` runs one worker per process: `resources.num_workers` > 1 needs torchrun (which
    sets WORLD_SIZE), and a separate vLLM engine needs Ray to place it: both refused here rather
    than after the model has loaded."""
    if not local:
        return
    world = os.environ.get("WORLD_SIZE")
    n = spec.resources.num_workers
    if world is None and n > 1:
        raise SpecError(
            f"resources.num_workers={n} with --local: one process runs one worker; start {n} with "
            f"`torchrun --nproc_per_node={n} -m jobs.finetune SPEC --local`, or set "
            "resources.num_workers=1"
        )
    if world is not None and world != str(n):
        raise SpecError(f"resources.num_workers={n} but WORLD_SIZE={world}: start as many processes as workers")
    r = spec.rollout
    if r is not None and r.engine == "vllm" and not r.vllm_url and r.vllm_placement == "separate":
        raise SpecError(
            "rollout.vllm_placement=separate with --local: without Ray nothing places an engine on resources "
            "of its own (rank 0 starts it beside itself); run on Ray, or leave rollout.vllm_placement unset"
        )


def prepare(spec_path: str, overrides: list[str], fresh: bool, *, local: bool = False, address: str | None = None):
    """Validate everything that can be checked on the driver; only then touch the output dir.

    Invariant: a refused spec creates nothing. The output directory is checked (new, empty or
    rayft's own; see `jobs.run.outputs.output_dir_problem`) and the data tokenized into its cache
    entry (`build_data`: refused data leaves no entry) before the run's lock is taken (which
    creates the directory) or --fresh moves anything; it is claimed only after every check has
    passed. The run's hold (`jobs.run.ownership.hold_output_dir`: checked, then locked by
    `jobs.run.run_hold`, the local lock and, for an object-store URI, the bucket's lease, then
    claimed) is taken before checkpoints are read or set aside and before anything is written in a
    bucket, and is held on return: the caller runs the job, then calls `jobs.run.run_hold.let_go(spec)`.
    An `address` (`--address`) is asked once whether a Ray cluster answers there
    (`jobs.launch.cluster_check`, bounded) before the output directory is touched."""
    from jobs.data.remote_data import localize
    from jobs.data.sources import read_once
    from jobs.run import mirror, run_hold
    from jobs.run.outputs import check_output_dir
    from jobs.run.ownership import hold_output_dir

    spec = load_spec(spec_path, overrides)
    check_local_workers(spec, local)
    check_fresh(spec, fresh)
    spec = localize(spec)  # data in a bucket: copied into rayft's cache on this machine, read from there
    with read_once():  # the count pass's parsed lines are the build's: each file is read once
        preflight(spec)
        check_output_dir(spec.output_location)  # an object store: the credentials, the bucket, the prefix
        if address and not local:
            from jobs.launch.cluster_check import check_cluster

            check_cluster(address)
        spec = absolutize(spec)
        build_data(spec)  # the last check that can refuse the data; the first write (the cache entry)
    # checked, locked (a second run into this directory or bucket prefix is refused here), then claimed
    hold_output_dir(
        spec.output_path,
        name=spec.name,
        location=spec.output_location,
        before_claim=lambda: resume_or_set_aside(spec, fresh),
    )
    try:
        mirror.claim(spec)
    except BaseException:
        run_hold.let_go(spec)
        raise
    return spec


def resume_or_set_aside(spec: JobSpec, fresh: bool) -> None:
    """Under the run's lock, before the directory is claimed: a resume that cannot be exact is
    refused before anything starts; --fresh sets the old checkpoints aside (never deletes them).
    An object-store run first brings the store's newest checkpoint into its staging directory
    (claimed first: it is rayft's)."""
    from jobs.run import checkpoint as ckpt
    from jobs.run import mirror
    from jobs.run.outputs import claim_output_dir, set_aside

    if mirror.store_of(spec) is not None:
        claim_output_dir(spec.output_path, name=spec.name)
        mirror.pull_newest(spec)
    newest = None if fresh else ckpt.resumable(spec.output_path / "checkpoints")
    if newest is not None:
        ckpt.check_resumable(ckpt.load_state(newest)["resume_key"], spec, str(newest))
    if fresh:
        moved = set_aside(spec.output_path / "checkpoints")
        if moved:
            logging.getLogger("rayft").warning("--fresh: previous checkpoints moved to %s", moved)


def check_fresh(spec: JobSpec, fresh: bool) -> None:
    """`--fresh` sets old checkpoints aside, never deleting them: a bucket has no rename, so with an
    object-store `run.output_dir` it is refused (for now) rather than deleting them there."""
    from jobs.run.storage import is_uri

    if fresh and is_uri(spec.output_location):
        raise SpecError(
            f"--fresh with run.output_dir={one_line(spec.output_location)}: not supported for object storage yet "
            "(the bucket's checkpoints would be deleted, not set aside); name a new prefix instead"
        )


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Like parse_args, but `section.field=value` words may appear anywhere, even after flags."""
    args, rest = parser.parse_known_args(argv)
    extra = [w for w in rest if "=" in w and not w.startswith("-")]
    unknown = [w for w in rest if w not in extra]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(getattr(args, "overrides", None) or []) + extra
    return args


def run(
    spec: JobSpec,
    *,
    local: bool = False,
    address: str | None = None,
    fresh: bool = False,
    on_progress: Callable[[StepRecord], None] | None = None,
) -> dict:
    """Train a prepared spec: on Ray (an address, the enclosing Ray job, or embedded), or `local`ly."""
    if local:
        from jobs.run import runlock
        from jobs.train.context import LocalContext
        from jobs.train.loop import train

        check_local_workers(spec, local)  # for callers that prepared without `local`
        os.environ.update(spec.run.env)  # what runtime_env does for Ray workers
        ctx = LocalContext(use_gpu=spec.resources.use_gpu, on_progress=on_progress)
        # rank 0 is this process: it verifies the lock `prepare` holds, by the run's token
        return train(spec, ctx, resume=not fresh, run_token=runlock.held_token(spec.output_path))
    from jobs.launch.on_ray import run_on_ray

    return run_on_ray(spec, address=address, resume=not fresh, on_progress=on_progress)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of one job run: `rayft run` and `python -m jobs.finetune` take the same."""
    parser.add_argument("spec", help="job spec YAML")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    parser.add_argument(
        "--address",
        metavar="GCS_ADDRESS",
        help="an existing Ray cluster to run on, as `ray.init` takes it: its GCS address HOST:6379, "
        "or ray://HOST:10001 (default: the enclosing Ray job's cluster, else an embedded local "
        "Ray). Not the Jobs API URL http://HOST:8265 that `rayft submit` takes",
    )
    parser.add_argument("--local", action="store_true", help="run in this process without Ray (torchrun-compatible)")
    parser.add_argument("--fresh", action="store_true", help="do not resume; existing checkpoints are moved aside")


def main(argv: list[str] | None = None) -> int:
    """The `ray job submit` entrypoint: the same preparation and run as `rayft run`, printing one
    plain line per optimizer step and summary.json at the end."""
    ap = argparse.ArgumentParser(prog="python -m jobs.finetune", description=__doc__.splitlines()[0])
    add_run_arguments(ap)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with secrets.redacted_output():  # as `rayft`: no line printed shows a credential
        return _main(ap, argv)


def _main(ap: argparse.ArgumentParser, argv: list[str] | None) -> int:
    from jobs.errors import RayftError, error_line
    from jobs.run import run_hold
    from jobs.run.outputs import format_step

    args = parse_with_overrides(ap, argv)
    try:
        spec = prepare(args.spec, args.overrides, args.fresh, local=args.local, address=args.address)
        try:
            summary = run(
                spec,
                local=args.local,
                address=args.address,
                fresh=args.fresh,
                on_progress=lambda rec: print(format_step(rec), flush=True),
            )
        finally:
            run_hold.let_go(spec)
    except RayftError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return e.exit_code
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
