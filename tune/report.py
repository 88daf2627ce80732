"""What a search leaves in `run.output_dir`:

results.csv / results.json   one row per trial and per configuration never launched
results.txt                  the rich results table, as printed
search.png                   the search's metric (eval loss, or eval_rewards/accuracies) by
                             accumulation steps per LR rule; estimated memory by micro-batch
                             with the budget line
best.yaml                    the best trial as a complete job spec (no `search` section):
                             `rayft run best.yaml` and `rayft submit best.yaml` take it unchanged
search_plan.json             the plan (every point, its estimate and status) and the spec fingerprint
tune/                        the Ray Tune experiment (`Tuner.restore` resumes from it)
trials/<trial_id>/           each trial's job outputs (metrics.jsonl, summary.json, adapter/, ...)
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import yaml

from jobs.memory import checkpointing_str
from jobs.run.outputs import write_json_atomic, write_text_atomic
from jobs.spec import JobSpec, reward_files, user_function

from .plan import TIME_ATTR, Plan, gib_str
from .spec import SearchSpec

COLUMNS = [
    "trial_id",
    "status",
    "micro_batch_size",
    "grad_accum_steps",
    "global_batch_size",
    "gradient_checkpointing",
    "checkpoint_every_n_layers",
    "lr_scaling",
    "reference_batch_size",
    "base_lr",
    "effective_lr",
    "estimate_gib",
    "budget_gib",
    "samples_seen",
    "tokens_seen",
    "steps",
    "eval_loss",
    "tokens_per_s",
    "trainings_started",
    "reason",
    "output_dir",
]
RESULTS_CSV, RESULTS_JSON, RESULTS_TXT = "results.csv", "results.json", "results.txt"
PLOT, BEST = "search.png", "best.yaml"
# How the results table heads each metric's column.
LABELS = {"eval_loss": "eval loss", "eval_rewards/accuracies": "eval acc", "eval_reward": "eval reward"}


def columns(plan: Plan) -> list[str]:
    """results.csv's columns: `beta` where the objective has one, `num_generations` where it samples
    completions (GRPO), the search's metric beside eval_loss."""
    cols = list(COLUMNS)
    if plan.has_generations:
        cols.insert(cols.index("lr_scaling") + 1, "num_generations")
    if plan.has_beta:
        cols.insert(cols.index("lr_scaling") + 1, "beta")
    if plan.metric != "eval_loss":
        cols.insert(cols.index("eval_loss") + 1, plan.metric)
    return cols


def pick_best(rows: list[dict], samples_per_trial: int, metric: str = "eval_loss", mode: str = "min") -> dict | None:
    """The best value of `metric` (lowest for mode "min", highest for "max") among trials that saw
    the full sample budget; ties (to 6 decimals) go to the faster one."""
    done = [
        r
        for r in rows
        if r["status"] == "finished" and r.get(metric) is not None and r["samples_seen"] >= samples_per_trial
    ]
    if not done:
        return None
    sign = 1 if mode == "min" else -1
    return min(done, key=lambda r: (sign * round(r[metric], 6), -(r["tokens_per_s"] or 0)))


def best_job_dict(raw: SearchSpec, best: dict) -> dict:
    """The winning configuration as a job spec, with the paths as the user wrote them."""
    d = raw.job_dict()
    d["name"] = f"{raw.name[:57].rstrip('-')}-best"
    d["batch"] = {
        "global_batch_size": best["global_batch_size"],
        "micro_batch_size": best["micro_batch_size"],
        "grad_accum_steps": best["grad_accum_steps"],
    }
    d["optim"].update(
        lr=best["base_lr"], lr_scaling=best["lr_scaling"], reference_batch_size=best["reference_batch_size"]
    )
    if best.get("beta") is not None:  # the beta the trial trained with, searched or the base job's
        d["objective"]["beta"] = best["beta"]
    if best.get("num_generations") is not None:  # GRPO: the trial's completions per prompt
        d["rollout"]["num_generations"] = best["num_generations"]
    # `auto` stays `auto` (with the budget): `rayft run` then picks the checkpointing the trial ran.
    gc = "auto" if d["memory"].get("gradient_checkpointing") == "auto" else bool(best["gradient_checkpointing"])
    d["memory"].update(gradient_checkpointing=gc, budget_gib=raw.budget)
    out = raw.run.output_dir
    d["run"].update(
        max_steps=best["steps"], epochs=None, output_dir=out if "{name}" in out else f"{out.rstrip('/')}/best-run"
    )
    _rewards_resolved(raw, d)
    # Fault injection is for drills of the search itself, not part of the result.
    d["run"]["env"] = {k: v for k, v in d["run"]["env"].items() if k != "RAYFT_FAULT"}
    JobSpec.model_validate(d)  # a complete, valid job spec, or a bug here
    return d


def _rewards_resolved(raw: SearchSpec, d: dict) -> None:
    """A user reward file as an absolute path in job dict `d`: best.yaml lives in the output directory,
    and a reward file is read relative to the spec file."""
    for key, file in reward_files(raw):
        entry = d["reward"]["functions"][int(key.split(".")[2])]
        entry["fn"] = f"{Path(file).resolve()}:{user_function(entry['fn'])[1]}"


def write_all(
    out: Path, raw: SearchSpec, plan: Plan, rows: list[dict], best: dict | None, notes: list[str], *, interrupted: bool
) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    with open(out / RESULTS_CSV, "w", newline="") as f:
        cols = columns(plan)
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    files["csv"] = str(out / RESULTS_CSV)
    summary = {
        "name": raw.name,
        "mode": raw.search.mode,
        "device": plan.device,
        "budget_gib": plan.budget_gib,
        "smallest_budget_gib": plan.smallest_budget_gib,
        "samples_per_trial": plan.samples_per_trial,
        "eval_every_samples": plan.eval_every_samples,
        "time_attr": TIME_ATTR,
        "metric": plan.metric,
        "metric_mode": plan.mode,
        "scheduler": raw.search.scheduler,
        "interrupted": interrupted,
        "notes": notes,
        "counts": {
            s: sum(r["status"] == s for r in rows)
            for s in ("finished", "stopped", "infeasible", "error", "skipped", "not run")
        },
        "best": best,
        "trials": rows,
    }
    write_json_atomic(out / RESULTS_JSON, summary)
    files["json"] = str(out / RESULTS_JSON)
    from rich.console import Console

    rec = Console(record=True, width=200, file=open(os.devnull, "w"))
    rec.print(results_table(rows, raw.name, plan))
    write_text_atomic(out / RESULTS_TXT, rec.export_text())
    files["table"] = str(out / RESULTS_TXT)
    png = plot(out / PLOT, rows, plan, raw.name)
    if png:
        files["png"] = str(png)
    best_path = out / BEST
    if best is not None:
        beta = "" if best.get("beta") is None else f", beta {best['beta']:g}"
        beta += "" if best.get("num_generations") is None else f", num_generations {best['num_generations']}"
        header = (
            f"# Best configuration of search {raw.name!r} (trial {best['trial_id']}): {value_str(plan, best)} "
            f"after {best['samples_seen']} samples; micro {best['micro_batch_size']} x "
            f"accum {best['grad_accum_steps']} x {raw.resources.num_workers} workers, lr {best['base_lr']:.4g} "
            f"({best['lr_scaling']} -> {best['effective_lr']:.4g}){beta}.\n"
            f"# A complete job spec: rayft run {BEST}\n"
        )
        write_text_atomic(best_path, header + yaml.safe_dump(best_job_dict(raw, best), sort_keys=False))
        files["best"] = str(best_path)
    elif best_path.exists():
        best_path.unlink()  # from an older state of this search; nothing finished now
    return files


def value_str(plan: Plan, row: dict) -> str:
    """The best trial's value, as the header of best.yaml and the CLI's last line give it:
    `eval_loss 1.2345`, `eval_rewards/accuracies 0.7500 (highest; eval_loss 0.6931)`, or GRPO's
    `eval_reward 0.4200 (highest)` (it has no held-out loss)."""
    text = f"{plan.metric} {row[plan.metric]:.4f}"
    if plan.metric == "eval_loss":
        return text
    best = "highest" if plan.mode == "max" else "lowest"
    loss = row.get("eval_loss")
    return f"{text} ({best})" if loss is None else f"{text} ({best}; eval_loss {_fmt(loss, '.4f')})"


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def results_table(rows: list[dict], name: str, plan: Plan):
    from rich.table import Table

    what = "eval loss" if plan.metric == "eval_loss" else f"{plan.metric} ({plan.mode})"
    t = Table(
        title=f"rayft tune {name}: {what} at {plan.samples_per_trial} samples per trial, "
        f"budget {gib_str(plan.budget_gib)} on {plan.device}"
    )
    beta = ["beta"] if plan.has_beta else []
    beta += ["gens"] if plan.has_generations else []
    metric = [] if plan.metric == "eval_loss" else [LABELS[plan.metric]]
    for col in (
        "trial",
        "status",
        "micro",
        "accum",
        "global",
        "ckpt",
        "lr rule",
        *beta,
        "base lr",
        "lr",
        "estimate",
        "samples",
        "eval loss",
        *metric,
        "tok/s",
        "note",
    ):
        t.add_column(col, overflow="fold")
    styles = {
        "finished": "green",
        "stopped": "yellow",
        "infeasible": "red",
        "error": "red",
        "skipped": "dim",
        "not run": "dim",
    }
    for r in rows:
        beta = [_fmt(r.get("beta"), "g")] if plan.has_beta else []
        beta += [_fmt(r.get("num_generations"), "d")] if plan.has_generations else []
        metric = [] if plan.metric == "eval_loss" else [_fmt(r.get(plan.metric), ".4f")]
        t.add_row(
            r["trial_id"] or "-",
            f"[{styles.get(r['status'], '')}]{r['status']}[/]",
            _fmt(r["micro_batch_size"], "d"),
            str(r["grad_accum_steps"]),
            str(r["global_batch_size"]),
            checkpointing_str(r.get("checkpoint_every_n_layers")),
            r["lr_scaling"],
            *beta,
            _fmt(r["base_lr"], ".3g"),
            _fmt(r["effective_lr"], ".3g"),
            gib_str(r["estimate_gib"]),
            str(r["samples_seen"] or "-"),
            _fmt(r["eval_loss"], ".4f"),
            *metric,
            _fmt(r["tokens_per_s"], ".0f"),
            r["reason"][:90],
        )
    return t


def plot(path: Path, rows: list[dict], plan: Plan, name: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    # Left: the search's metric at the full sample budget by accumulation steps, one line per LR
    # rule (the best trial of each accumulation: over lrs and betas); trials ASHA stopped are
    # crosses at their last value (fewer samples).
    colors = {"none": "tab:blue", "linear": "tab:orange", "sqrt": "tab:green"}
    metric, better = plan.metric, (min if plan.mode == "min" else max)
    over = "best lr and beta" if len({r.get("beta") for r in rows if r.get("beta") is not None}) > 1 else "best lr"
    for rule in ("none", "linear", "sqrt"):
        fin = [r for r in rows if r["lr_scaling"] == rule and r["status"] == "finished" and r.get(metric) is not None]
        if fin:
            best_by_accum: dict[int, float] = {}
            for r in fin:
                a = r["grad_accum_steps"]
                best_by_accum[a] = better(best_by_accum.get(a, r[metric]), r[metric])
            xs = sorted(best_by_accum)
            ax1.plot(xs, [best_by_accum[x] for x in xs], "o-", color=colors[rule], label=f"{rule} (finished, {over})")
        stopped = [
            r for r in rows if r["lr_scaling"] == rule and r["status"] == "stopped" and r.get(metric) is not None
        ]
        if stopped:
            ax1.scatter(
                [r["grad_accum_steps"] for r in stopped],
                [r[metric] for r in stopped],
                marker="x",
                color=colors[rule],
                label=f"{rule} (stopped early by ASHA)",
            )
    ax1.set_xscale("log", base=2)
    accums = sorted({r["grad_accum_steps"] for r in rows if r["status"] in ("finished", "stopped")})
    if accums:
        ax1.set_xticks(accums, [str(a) for a in accums])
        ax1.minorticks_off()
    ax1.set_xlabel("gradient accumulation steps")
    label = "eval loss" if metric == "eval_loss" else metric
    ax1.set_ylabel(f"{label} (dots: at {plan.samples_per_trial} samples)")
    ax1.set_title(f"{label} by accumulation, per LR scaling rule")
    ax1.grid(alpha=0.3)
    if ax1.has_data():
        ax1.legend(fontsize=8)
    # Right: the memory estimate by micro-batch, checkpointing off and on, and the budget.
    micros = sorted(plan.memory)
    if micros:
        x = range(len(micros))
        unit, scale = ("MiB", 1024) if plan.budget_gib < 1 else ("GiB", 1)
        off = [plan.memory[m]["off"] * scale for m in micros]
        on = [plan.memory[m]["on"] * scale for m in micros]
        budget = plan.budget_gib * scale
        ax2.bar(
            [i - 0.2 for i in x],
            off,
            0.4,
            label="checkpointing off",
            color=["tab:red" if v > budget else "tab:blue" for v in off],
        )
        ax2.bar(
            [i + 0.2 for i in x],
            on,
            0.4,
            label="checkpointing on",
            alpha=0.6,
            color=["tab:red" if v > budget else "tab:cyan" for v in on],
        )
        ax2.axhline(budget, color="black", linestyle="--", label=f"budget {gib_str(plan.budget_gib)}")
        ax2.set_xticks(list(x), [str(m) for m in micros])
        ax2.set_xlabel("micro-batch size")
        ax2.set_ylabel(f"estimated memory per device ({unit}, {plan.device})")
        ax2.set_title("memory estimate (red: over budget)")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3, axis="y")
    fig.suptitle(f"rayft tune {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
