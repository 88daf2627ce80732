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

from .spec import SpecError, absolutize, load_spec


def preflight(spec) -> None:
    """Checks that need the data files but not the model: run before anything is created."""
    from .data import read_jsonl

    for i, p in enumerate(spec.data.path):
        read_jsonl(p, "data.path" if len(spec.data.path) == 1 else f"data.path.{i}")
    if spec.data.eval_path:
        read_jsonl(spec.data.eval_path, "data.eval_path")


def prepare(spec_path: str, overrides: list[str], fresh: bool):
    from .checkpoint import set_aside

    spec = load_spec(spec_path, overrides)
    preflight(spec)
    spec = absolutize(spec)
    if fresh:
        moved = set_aside(spec.output_path)
        if moved:
            logging.getLogger("rayft").warning("--fresh: previous checkpoints moved to %s", moved)
    return spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.finetune", description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="job spec YAML")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    ap.add_argument("--address", help="Ray cluster address (default: the enclosing Ray job's, else a local Ray)")
    ap.add_argument("--local", action="store_true", help="run without Ray (torchrun-compatible)")
    ap.add_argument("--fresh", action="store_true", help="ignore existing checkpoints (they are moved aside)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        spec = prepare(args.spec, args.overrides, args.fresh)
        if args.local:
            from .context import LocalContext
            from .loop import train

            summary = train(spec, LocalContext(use_gpu=spec.resources.use_gpu), resume=not args.fresh)
        else:
            from .launch import run_on_ray

            def show(rec: dict) -> None:
                print(f"step {rec['step']}/{rec['total_steps']} loss {rec['loss']:.4f} "
                      f"lr {rec['lr']:.3g} tokens/s {rec['tokens_per_s']:.0f}", flush=True)

            summary = run_on_ray(spec, address=args.address, resume=not args.fresh, on_progress=show)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
