"""`python -m jobs.finetune SPEC [section.field=value ...]`: run one fine-tuning job.

This is the entrypoint `ray job submit` uses: inside a Ray job it trains on that cluster,
elsewhere on an embedded local Ray. `--local` runs without Ray at all (one process, or
several under `torchrun`), which is how GPU benchmarks run on machines without Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .spec import absolutize, load_spec


def preflight(spec) -> None:
    """Checks that need the data files but not the model: run before anything is created."""
    from .data import read_jsonl

    for i, p in enumerate(spec.data.path):
        read_jsonl(p, "data.path" if len(spec.data.path) == 1 else f"data.path.{i}")
    if spec.data.eval_path:
        read_jsonl(spec.data.eval_path, "data.eval_path")
    if spec.data.packing:
        from .memory import config_from_spec
        from .model import check_packing

        check_packing(config_from_spec(spec))


def prepare(spec_path: str, overrides: list[str], fresh: bool):
    """Validate everything that can be checked on the driver; only then touch the output dir."""
    from . import checkpoint as ckpt
    from .outputs import set_aside

    spec = load_spec(spec_path, overrides)
    preflight(spec)
    spec = absolutize(spec)
    newest = None if fresh else ckpt.newest_complete(spec.output_path / "checkpoints")
    if newest is not None:  # refuse a resume that cannot be exact, before anything starts
        ckpt.check_resumable(ckpt.load_state(newest)["resume_key"], spec, str(newest))
    if fresh:
        moved = set_aside(spec.output_path / "checkpoints")
        if moved:
            logging.getLogger("rayft").warning("--fresh: previous checkpoints moved to %s", moved)
    return spec


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


def run(spec, *, local: bool = False, address: str | None = None, fresh: bool = False,
        on_progress=None) -> dict:
    """Train a prepared spec: on Ray (an address, the enclosing Ray job, or embedded), or `local`ly."""
    if local:
        import os

        from .context import LocalContext
        from .loop import train

        os.environ.update(spec.run.env)  # what runtime_env does for Ray workers
        return train(spec, LocalContext(use_gpu=spec.resources.use_gpu, on_progress=on_progress),
                     resume=not fresh)
    from .launch import run_on_ray

    return run_on_ray(spec, address=address, resume=not fresh, on_progress=on_progress)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of one job run: `rayft run` and `python -m jobs.finetune` take the same."""
    parser.add_argument("spec", help="job spec YAML")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    parser.add_argument("--address", help="Ray cluster (GCS) address, e.g. 127.0.0.1:6379 or ray://host:10001 "
                                          "(default: the enclosing Ray job's cluster, else an embedded local Ray)")
    parser.add_argument("--local", action="store_true", help="run in this process without Ray (torchrun-compatible)")
    parser.add_argument("--fresh", action="store_true", help="do not resume; existing checkpoints are moved aside")


def main(argv: list[str] | None = None) -> int:
    """The `ray job submit` entrypoint: the same preparation and run as `rayft run`, printing one
    plain line per optimizer step and summary.json at the end."""
    from .errors import RayftError
    from .outputs import format_step

    ap = argparse.ArgumentParser(prog="python -m jobs.finetune", description=__doc__.splitlines()[0])
    add_run_arguments(ap)
    args = parse_with_overrides(ap, argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        spec = prepare(args.spec, args.overrides, args.fresh)
        summary = run(spec, local=args.local, address=args.address, fresh=args.fresh,
                      on_progress=lambda rec: print(format_step(rec), flush=True))
    except RayftError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
