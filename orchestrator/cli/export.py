"""`rayft export` and `rayft generate`: what a user does with a finished run (`jobs.after.export`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from .output import say


def cmd_export(args) -> int:
    from jobs.after.export import export
    from jobs.run.remote_run import export_target, local_run
    from jobs.run.storage import is_uri

    to = Path(args.to) if args.to else None
    if is_uri(args.output_dir):  # fetched into rayft's cache; the export is written here, not in the bucket
        check_local_target(args.to)
        to = to or export_target(args.output_dir, args.merge)
    target = export(local_run(args.output_dir), merge=args.merge, dtype=args.dtype, to=to)
    say(f"{'merged model' if args.merge else 'adapter'} exported to {target}")
    print(target)
    return 0


def check_local_target(to: str | None) -> None:
    """`--to` is a local directory: an export is not written into a bucket."""
    from jobs.errors import UserError
    from jobs.spec.sections import URI

    if to and URI.match(to.strip()):
        raise UserError(f"--to {to[:120]}: a local directory only (copy the export to a bucket with your own tools)")


def cmd_generate(args) -> int:
    from jobs.after.export import generate, load_for_generation, prompts_from
    from jobs.run.remote_run import local_run

    check_generate_arguments(args)
    model, tok = load_for_generation(local_run(args.output_dir))
    opts = dict(chat=args.chat, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    if args.prompt is not None:
        generate(model, tok, args.prompt, **opts)  # streams the answer to stdout
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        say("one prompt per line; Ctrl-D ends")
    for prompt in prompts_from(_lines(interactive)):
        generate(model, tok, prompt, **opts)
    return 0


# Sampling temperatures beyond this are noise: the distribution is flat to float precision.
MAX_TEMPERATURE = 100.0
MAX_NEW_TOKENS = 1_000_000
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit seed


def check_generate_arguments(args) -> None:
    """`rayft generate`'s own arguments, refused in one line before the model loads."""
    from jobs.errors import UserError

    if not 0 < args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be from 1 to {MAX_NEW_TOKENS}")
    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= MAX_TEMPERATURE):
        raise UserError(f"--temperature {args.temperature}: must be a number from 0 (greedy) to {MAX_TEMPERATURE:g}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UserError(f"--seed {str(args.seed)[:40]}: must be from 0 to 2**63-1")
    if args.prompt is not None and not _is_text(args.prompt):
        raise UserError("the prompt is not UTF-8 text (undecodable bytes in the argument)")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")  # an undecodable argv byte arrives as a lone surrogate
    except UnicodeEncodeError:
        return False
    return True


def _lines(interactive: bool):
    """stdin's lines, decoded one by one (so an undecodable one is named by its number)."""
    from jobs.errors import UserError

    raw = getattr(sys.stdin, "buffer", None)
    n = 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        data = raw.readline() if raw is not None else sys.stdin.readline()
        if not data:
            return
        n += 1
        try:
            line = data.decode("utf-8") if isinstance(data, bytes) else data
        except UnicodeDecodeError as e:
            raise UserError(
                f"stdin: line {n} is not UTF-8 text (byte 0x{e.object[e.start]:02x}); give prompts as UTF-8"
            ) from None
        if not _is_text(line):
            raise UserError(f"stdin: line {n} is not UTF-8 text; give prompts as UTF-8")
        yield line


def register(sub) -> None:
    ex = sub.add_parser("export", help="export a finished run's adapter, or merge it into its base (--merge)")
    ex.add_argument("output_dir", help="the run's output directory (run.output_dir: a local path, s3:// or gs://)")
    ex.add_argument(
        "--merge",
        action="store_true",
        help="merge the adapter into the base: a standalone Hugging Face model directory",
    )
    ex.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32", help="dtype of the merged weights")
    ex.add_argument(
        "--to",
        help="target directory, local (default: <output_dir>/merged or <output_dir>/adapter-export; for a run in a "
        "bucket ./<last part of its prefix>-merged or -adapter-export)",
    )
    ex.set_defaults(fn=cmd_export)

    gen = sub.add_parser("generate", help="generate with a run's adapter (or a merged export); streams the answer")
    gen.add_argument(
        "output_dir", help="a run's output directory, an adapter directory or a merged export (local, s3:// or gs://)"
    )
    gen.add_argument("prompt", nargs="?", help="the prompt (none: read prompts from stdin, one per line)")
    gen.add_argument("--chat", action="store_true", help="render the prompt through the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.set_defaults(fn=cmd_generate)
