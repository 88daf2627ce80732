"""`rayft run | eval | spec`: run a job now, evaluate an adapter, inspect specs."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from jobs.run.outputs import format_step
from jobs.run.step_record import StepRecord

from . import Parser
from .output import console

if TYPE_CHECKING:
    from rich.progress import TaskID

    from jobs.spec import JobSpec

# ---- rayft run -------------------------------------------------------------------------------

# What `batch.global_batch_size` counts, after the number (a preference objective: pairs).
BATCH_UNITS = {"sft": "", "grpo": " completions"}


def cmd_run(args) -> int:
    from jobs.finetune import prepare, run
    from jobs.run import run_hold

    spec = prepare(args.spec, args.overrides, args.fresh, local=args.local, address=args.address)  # holds the lock
    try:
        with _Progress(spec) as bar:
            summary = run(spec, local=args.local, address=args.address, fresh=args.fresh, on_progress=bar.update)
    finally:
        run_hold.let_go(spec)
    _summary_table(summary, spec)
    return 0


class _Progress:
    """A progress bar per optimizer step with loss and tokens/s (plain lines when not a TTY)."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.console = console()
        self.task: TaskID | None = None

    def __enter__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tok_s]} tok/s"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.progress.__enter__()
        return self

    def update(self, rec: StepRecord) -> None:
        loss = f"{rec.loss:.4f}"
        if (accuracies := rec.value("rewards/accuracies")) is not None:  # preference: TRL's accuracy, margin
            loss += f" acc {accuracies:.2f} margin {rec.value('rewards/margins'):.3g}"
        fields: dict[str, Any] = dict(loss=loss, tok_s=f"{rec.tokens_per_s:.0f}")
        if self.task is None:
            self.task = self.progress.add_task(self.spec.name, total=rec.total_steps, completed=rec.step - 1, **fields)
        self.progress.update(self.task, completed=rec.step, **fields)
        if not self.console.is_terminal:
            print(format_step(rec), file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _summary_table(summary: dict, spec: JobSpec) -> None:
    from rich.table import Table

    from jobs.memory import checkpointing_str
    from jobs.run.summary import RunSummary

    s = RunSummary.from_json(summary)
    accuracy = s.stat("eval_rewards/accuracies")
    t = Table(title=f"rayft run {spec.name}", show_header=False)
    rows = [
        ("steps", f"{s.steps} (resumed from {s.resumed_from_step})" if s.resumed_from_step else str(s.steps)),
        ("loss first -> final", f"{_num(s.first_loss, '.4f')} -> {_num(s.final_loss, '.4f')}"),
        ("eval loss", _num(s.eval_loss, ".4f")),
        *(
            [
                (
                    "eval preference (held out)",
                    f"accuracy {accuracy:.1%}, margin {s.stat('eval_rewards/margins'):.4f} ({s.objective})",
                )
            ]
            if accuracy is not None
            else []
        ),
        (
            "global batch",
            f"{s.global_batch_size}{BATCH_UNITS.get(s.objective, ' pairs')} "
            f"= {s.num_workers} workers x {s.grad_accum_steps} accum x {s.micro_batch_size} micro",
        ),
        ("effective lr", f"{s.effective_lr:.3g}"),
        ("precision / checkpointing", f"{s.precision} / {checkpointing_str(s.checkpoint_every_n_layers)}"),
        ("tokens/s (mean)", f"{s.mean_tokens_per_s:.0f}" if s.mean_tokens_per_s else "-"),
        (
            "peak memory / estimate",
            f"{_num(s.peak_mem_gib, '.2f')} GiB / {s.estimate_gib:.2f} GiB"
            + (" (CPU: whole-process RSS vs training tensors)" if s.peak_mem_kind == "cpu_max_rss" else ""),
        ),
        ("skipped steps (fp16)", str(s.skipped_steps)),
        ("wall time", f"{s.wall_time_s:.1f} s"),
        ("adapter", s.adapter_dir),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console().print(t)


# ---- rayft eval ------------------------------------------------------------------------------


def cmd_eval(args) -> int:
    from rich.table import Table

    from jobs.after.evaluate import evaluate
    from jobs.data.remote_data import localize
    from jobs.spec import absolutize, load_spec

    spec = absolutize(localize(load_spec(args.spec, args.overrides)))
    result = evaluate(spec, args.adapter, max_new_tokens=args.max_new_tokens)
    if "prompts" in result:  # held-out prompts, scored by the reward functions (online RL)
        _reward_table(result, spec)
        return 0
    if "models" in result:
        _preference_table(result, spec)
        return 0
    t = Table(title=f"rayft eval {spec.name}: exact match on {result['records']} held-out prompts")
    t.add_column("model")
    t.add_column("exact match", justify="right")
    t.add_row("base", f"{result['base_exact_match']:.1%}")
    if "adapter_exact_match" in result:
        t.add_row(f"base + adapter ({result['adapter_dir']})", f"{result['adapter_exact_match']:.1%}")
    console().print(t)
    for ex in result["examples"][:3]:
        console().print(
            f"  want {ex['reference']!r}  base {ex['base']!r}"
            + (f"  adapter {ex['adapter']!r}" if "adapter" in ex else "")
        )
    return 0


def _reward_table(result: dict, spec: JobSpec) -> None:
    """One row per model scored (base, starting adapter, trained adapter): the held-out mean reward
    of greedy answers, each reward function's mean, exact match where a function is exact_match."""
    from rich.table import Table

    from jobs.after.evaluate_preference import ROLES

    out = console()
    if not out.is_terminal:
        out.width = max(out.width, 120)
    exact = "exact_match" in result["models"][0]  # shown once, as a share, in its own column
    means = [
        k for k in result["models"][0] if k.startswith("rewards/") and not (exact and k.endswith("exact_match/mean"))
    ]
    t = Table(title=f"rayft eval {spec.name}: {result['prompts']} held-out prompts, greedy, mean reward")
    for name in ("model", "reward", *means, *(["exact match"] if exact else [])):
        t.add_column(
            name.removeprefix("rewards/").removesuffix("/mean"), justify="left" if name == "model" else "right"
        )
    for row in result["models"]:
        cells = [f"{row['reward']:.3f}", *(f"{row[k]:.3f}" for k in means)]
        cells += [f"{row['exact_match']:.1%}"] if "exact_match" in row else []
        t.add_row(ROLES[row["model"]], *cells)
    out.print(t)
    for row in result["models"][1:]:
        out.print(f"  {ROLES[row['model']]}: {row['adapter_dir']}")
    for ex in result["examples"][:3]:
        out.print("  " + "  ".join(f"{role} {ex[role]!r}" for role in ROLES if role in ex))


def _preference_table(result: dict, spec: JobSpec) -> None:
    """One row per model scored (base, starting adapter, trained adapter): exact match, preference
    accuracy and mean margin for each; TRL's rewards for the trained adapter. Not folded to 80
    columns when stderr is not a terminal (a log keeps each row on one line)."""
    from rich.table import Table

    from jobs.after.evaluate_preference import ROLES

    out = console()
    if not out.is_terminal:
        out.width = max(out.width, 120)
    dropped = sum(result["dropped"].values())
    t = Table(
        title=f"rayft eval {spec.name}: {result['pairs']} held-out pairs"
        + (f" ({dropped} dropped)" if dropped else "")
        + f", {result['objective']} beta {result['beta']:g}"
    )
    for name in ("model", "exact match", "pref. accuracy", "mean margin", "rewards/accuracies", "rewards/margins"):
        t.add_column(name, justify="left" if name == "model" else "right")
    for row in result["models"]:
        t.add_row(
            ROLES[row["model"]],
            f"{row['exact_match']:.1%}",
            f"{row['preference_accuracy']:.1%}",
            f"{row['mean_margin']:+.3f}",
            "-" if "rewards/accuracies" not in row else f"{row['rewards/accuracies']:.1%}",
            "-" if "rewards/margins" not in row else f"{row['rewards/margins']:+.4f}",
        )
    out.print(t)
    for row in result["models"][1:]:
        out.print(f"  {ROLES[row['model']]}: {row['adapter_dir']}")
    if result.get("reference"):
        out.print(
            f"  rewards against the reference: {ROLES[result['reference']]} (beta {result['beta']:g}); "
            "margins in nats of summed response log-probability"
        )
    for ex in result["examples"][:3]:
        out.print(
            f"  want {ex['chosen']!r} (not {ex['rejected']!r})  "
            + "  ".join(f"{role} {ex[role]!r}" for role in ROLES if role in ex)
        )


# ---- rayft spec ------------------------------------------------------------------------------


def cmd_spec(args) -> int:
    from jobs.spec import json_schema, load_spec

    if args.spec_cmd == "schema":
        print(json.dumps(json_schema(), indent=2))
        return 0
    spec = load_spec(args.spec, args.overrides)
    print(spec.to_yaml(), end="")
    return 0


def register(sub) -> None:
    from jobs.finetune import add_run_arguments

    run = sub.add_parser("run", help="run a job now (embedded local Ray unless --address)")
    add_run_arguments(run)  # the same arguments as `python -m jobs.finetune`, the ray job submit entrypoint
    run.set_defaults(fn=cmd_run)

    ev = sub.add_parser(
        "eval",
        help="exact match on data.eval_path, base model vs base + adapter (preference "
        "specs: also preference accuracy and margins on held-out pairs)",
    )
    ev.add_argument("spec")
    ev.add_argument("overrides", nargs="*", metavar="section.field=value")
    ev.add_argument("--adapter", help="adapter directory (default: <run.output_dir>/adapter)")
    ev.add_argument("--max-new-tokens", type=int, default=16)
    ev.set_defaults(fn=cmd_eval)

    spec = sub.add_parser("spec", help="inspect specs")
    ssub = spec.add_subparsers(dest="spec_cmd", required=True, parser_class=Parser)
    ssub.add_parser("schema", help="print the JSON schema of a job spec")
    chk = ssub.add_parser("check", help="validate a spec (with overrides) and print it with defaults filled in")
    chk.add_argument("spec")
    chk.add_argument("overrides", nargs="*", metavar="section.field=value")
    spec.set_defaults(fn=cmd_spec)
