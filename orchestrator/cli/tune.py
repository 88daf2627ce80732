"""`rayft estimate` and `rayft tune`.

    rayft estimate SPEC [k=v ...] [--json] [--device cpu|cuda]
        the memory plan of the spec (jobs.memory.plan_for_spec: the strategy and checkpointing the
        job will use, its components and total against memory.budget_gib), DDP and FSDP (and, for a
        quantized base, unquantized beside it) per GPU side by side, the components with
        checkpointing off and on beside it, and every (micro_batch_size, grad_accum_steps) pair
        that splits the global batch over the workers, with checkpointing off and on.
    rayft tune SPEC [k=v ...] [--resume | --fresh] [--plan] [--address ADDR] [--num-cpus N]
        the search of a search spec (a job spec plus `search`; see tune/spec.py): the plan
        (tune.plan), then the trials on Ray (tune.run), compared on `search.metric` (eval loss,
        a preference objective's held-out accuracy when it searches `objective.beta`, or GRPO's held-out
        mean reward `eval_reward`).
        With `run.output_dir: s3://...` / `gs://...` the search runs in its staging directory under
        the prefix's lease and is uploaded when it returns (`tune.storage`).

Every user mistake raises `jobs.errors.SpecError` before anything starts; `orchestrator.cli.main`
prints it as one line, exit code 2.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from jobs.errors import SpecError

if TYPE_CHECKING:
    from jobs.spec import JobSpec


def register(sub) -> None:
    est = sub.add_parser("estimate", help="memory estimate and the feasible (micro-batch, accumulation) pairs")
    est.add_argument("spec", help="job spec (or search spec) YAML")
    est.add_argument("overrides", nargs="*", metavar="section.field=value")
    est.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    est.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="estimate for this device (default: cuda with resources.use_gpu, else cpu)",
    )
    est.set_defaults(fn=cmd_estimate)

    tn = sub.add_parser(
        "tune",
        help=(
            "search accumulation steps, LR scaling, an objective's beta and GRPO's num_generations "
            "under a memory budget (Ray Tune)"
        ),
    )
    tn.add_argument("spec", help="search spec YAML: a job spec plus a `search` section")
    tn.add_argument("overrides", nargs="*", metavar="section.field=value")
    g = tn.add_mutually_exclusive_group()
    g.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="resume the interrupted search in run.output_dir (the default when there is one)",
    )
    g.add_argument("--fresh", action="store_true", help="start over; a previous search is moved aside")
    tn.add_argument("--plan", action="store_true", help="print the plan (feasible, infeasible, skipped) and exit")
    tn.add_argument("--address", help="Ray cluster address (default: an embedded local Ray)")
    tn.add_argument("--num-cpus", type=int, help="logical CPUs of the embedded Ray (default: enough for 2 trials)")
    tn.set_defaults(fn=cmd_tune)


# ---- estimate ----------------------------------------------------------------------------


def _load_any(path: str, overrides: list[str]):
    """A job spec, or a search spec's job part with the search budget as its memory.budget_gib
    (what each trial runs with); and the budget."""
    from jobs.spec import JobSpec, apply_overrides, load_spec, read_yaml

    raw = apply_overrides(read_yaml(path), overrides or [])
    if "search" in raw:
        from tune.spec import load_search_spec

        s = load_search_spec(path, data=raw, files=False)
        job = s.job_dict()
        job["memory"]["budget_gib"] = s.budget
        return JobSpec.model_validate(job), s.budget
    spec = load_spec(path, data=raw, files=False)  # the estimate reads the model config, no data
    return spec, spec.memory.budget_gib


def estimate_report(spec: JobSpec, budget, device: str, where: str) -> dict:
    """The plan `spec` runs on `device` (`jobs.memory.plan_for_spec`: its strategy, checkpointing,
    components and total), checkpointing off and on beside it, DDP and FSDP (and unquantized and
    quantized) side by side (`strategy_table`), and every (micro, accumulation) split."""
    from jobs import memory

    try:
        config = memory.config_from_spec(spec)
        plan = memory.plan_for_spec(spec, device=device, config=config)
        off = memory.estimate_for_spec(spec, gradient_checkpointing=False, device=device, config=config)
        on = memory.estimate_for_spec(spec, gradient_checkpointing=True, device=device, config=config)
        pairs = memory.feasible_pairs(spec, budget, device=device)
        for row in pairs:
            row["estimate_bytes"] = memory.estimate_for_spec(
                spec,
                micro_batch_size=row["micro_batch_size"],
                gradient_checkpointing=row["gradient_checkpointing"],
                device=device,
                config=config,
            ).total_bytes
        smallest = memory.smallest_budget_gib(spec, device=device)
        strategies = memory.strategy_table(spec, device=device, config=config)
    except ValueError as e:  # SpecError included: the field it names, prefixed with the spec's path
        raise SpecError(f"{where}: {e}") from None
    chosen = plan.estimate
    return {
        "name": spec.name,
        "model": spec.model.name,
        "device": device,
        "precision": plan.precision,
        "seq_len": plan.seq_len,
        "num_workers": spec.resources.num_workers,
        "global_batch_size": spec.batch.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum_steps": spec.grad_accum_steps,
        "gradient_checkpointing": spec.memory.gradient_checkpointing,
        "checkpointing_used": plan.checkpoint_every_n_layers > 0,
        "checkpoint_every_n_layers": plan.checkpoint_every_n_layers,
        "strategy": plan.strategy,
        "reshard_after_forward": plan.reshard_after_forward,
        "quantization": plan.quantization,
        "budget_gib": budget,
        "components": dict(chosen.components),
        "total_bytes": chosen.total_bytes,
        "total_gib": chosen.total_gib,
        "fits": None if budget is None else plan.fits,
        "by_checkpointing": {
            k: {
                "components": dict(e.components),
                "total_bytes": e.total_bytes,
                "total_gib": e.total_gib,
                "vllm_engine": e.details.get("vllm_engine"),  # a sleeping engine changes how the total adds up
            }
            for k, e in (("off", off), ("on", on))
        },
        "strategies": strategies,
        "transient_components": list(memory.TRANSIENT_COMPONENTS),
        "pairs": pairs,
        "smallest_budget_gib": smallest,
        "generation": generation_report(spec, plan),
        # the vLLM engine rayft starts, by part in bytes and where (`colocated`, `devices`, `per_device`)
        "vllm_engine": plan.vllm_engine,
    }


def generation_report(spec: JobSpec, plan) -> dict | None:
    """Online RL in-process: the generation batch the plan runs, whether the spec fixed it, the
    worker's share it is capped by, and the parts of its peak in bytes (`jobs.memory.generation`);
    None where nothing is generated in the training process."""
    parts = plan.estimate.details.get("generation")
    if not parts:
        return None
    rollout = spec.online.rollout  # generation in the training process: a GRPO spec's
    return {
        "generation_batch_size": plan.generation_batch_size,
        "chosen_by_plan": rollout.generation_batch_size is None,
        "share": spec.batch.global_batch_size // spec.resources.num_workers,
        "prompt_tokens": spec.data.max_seq_len - rollout.max_completion_length,
        "completion_tokens": rollout.max_completion_length,
        "bytes": {k: v for k, v in parts.items() if k != "generation_batch_size"},
    }


def cmd_estimate(args) -> int:
    from jobs.memory import MemoryEstimate, checkpointing_str, strategy_str
    from tune.plan import gib_str

    spec, budget = _load_any(args.spec, args.overrides)
    device = args.device or spec.planned_device
    rep = estimate_report(spec, budget, device, args.spec)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0

    from rich.console import Console
    from rich.table import Table

    con = Console()
    by = rep["by_checkpointing"]
    off, on = (MemoryEstimate(by[k]["components"], {"vllm_engine": by[k]["vllm_engine"]}) for k in ("off", "on"))
    # Headings as lines, not table titles: rich folds a title to the table's width.
    packed = " (packed rows)" if spec.data.packing else ""
    quant = "" if rep["quantization"] == "none" else f", {rep['quantization']} base"
    con.print(
        f"[bold]{spec.name}[/]: {spec.model.name}, micro-batch {rep['micro_batch_size']} "
        f"x seq {rep['seq_len']}{packed}, "
        f"{rep['num_workers']} worker(s), {rep['precision']}{quant} on {device}",
        soft_wrap=True,
    )
    t = Table()
    t.add_column("component")
    t.add_column("checkpointing off", justify="right")
    t.add_column("checkpointing on", justify="right")
    for (name, g_off), (_, g_on) in zip(off.table(), on.table(), strict=True):
        label = f"{name} (transient)" if name in rep["transient_components"] else name
        style = "bold" if name == "total" else None
        t.add_row(label, gib_str(g_off), gib_str(g_on), style=style)
    con.print(t)
    used = checkpointing_str(rep["checkpoint_every_n_layers"])
    _print_generation(con, rep["generation"])
    _print_separate_engine(con, rep["vllm_engine"], budget)
    _print_strategies(con, rep, budget)
    line = (
        f"total {gib_str(rep['total_gib'])} ({strategy_str(rep['strategy'], rep['reshard_after_forward'])}, "
        f"checkpointing {used}, memory.gradient_checkpointing={rep['gradient_checkpointing']})"
    )
    if budget is None:
        con.print(f"{line}; no memory.budget_gib set", soft_wrap=True)
    else:
        verdict = "[green]fits[/]" if rep["fits"] else "[red]exceeds[/]"
        con.print(f"{line} {verdict} the budget of {gib_str(budget)}", soft_wrap=True)
    con.print(
        f"[bold](micro_batch_size, grad_accum_steps) pairs for global batch {rep['global_batch_size']} over "
        f"{rep['num_workers']} worker(s)[/]" + ("" if budget is None else f", budget {gib_str(budget)}"),
        soft_wrap=True,
    )
    p = Table()
    for col in ("micro", "accum", "checkpointing off", "checkpointing on"):
        p.add_column(col, justify="right")
    rows: dict[int, dict] = {}
    for r in rep["pairs"]:
        rows.setdefault(r["micro_batch_size"], {"accum": r["grad_accum_steps"]})[r["gradient_checkpointing"]] = r
    for mb, r in rows.items():
        cells = []
        for gc in (False, True):
            x = r[gc]
            mark = "" if budget is None else (" [green]fits[/]" if x["fits"] else " [red]over[/]")
            cells.append(gib_str(x["estimate_bytes"] / 1024**3) + mark)
        p.add_row(str(mb), str(r["accum"]), *cells)
    con.print(p)
    con.print(
        f"smallest budget (micro-batch 1, checkpointing on): {gib_str(rep['smallest_budget_gib'])}", soft_wrap=True
    )
    return 0


def _print_generation(con, gen: dict | None) -> None:
    """Online RL: the generation batch and the parts of generation's peak (before the forward:
    weighed against the training step's peak, not added to it)."""
    if gen is None:
        return
    from tune.plan import gib_str

    b = gen["bytes"]
    how = "the plan's choice" if gen["chosen_by_plan"] else "rollout.generation_batch_size"
    con.print(
        f"[bold]generation[/]: {gen['generation_batch_size']} completions at once ({how}; "
        f"{gen['share']} per worker a step), prompt {gen['prompt_tokens']} + completion "
        f"{gen['completion_tokens']} tokens: KV cache {gib_str(b['kv_cache'] / 1024**3)}, prefill "
        f"{gib_str(b['prefill'] / 1024**3)}, decode {gib_str(b['decode'] / 1024**3)} (sampler "
        f"{gib_str(b['sampler'] / 1024**3)}), LoRA copies {gib_str(b['lora_copies'] / 1024**3)}; peak "
        f"{gib_str(b['peak_bytes'] / 1024**3)} beside the static memory, weighed against training's "
        "peak (not added)",
        soft_wrap=True,
    )


def _print_separate_engine(con, engine: dict | None, budget) -> None:
    """A vLLM engine on devices of its own (`rollout.vllm_placement: separate`): not a row of the
    table (that is the training device's), its share on each of its devices against the budget."""
    if engine is None or engine["colocated"]:
        return
    from tune.plan import gib_str

    each = engine["per_device"] / 1024**3
    verdict = "" if budget is None else (" [green]fits[/]" if each <= budget else " [red]exceeds[/]") + " the budget"
    con.print(
        f"[bold]vllm_engine[/] (rollout.vllm_placement=separate, on {engine['devices']} device(s) of its own, not in "
        f"the total below): {gib_str(each)} per device (weights {gib_str(engine['weights'] / 1024**3)}, LoRA slot "
        f"{gib_str(engine['lora_slot'] / 1024**3)}, KV cache {gib_str(engine['kv_cache'] / 1024**3)}, context "
        f"{gib_str(engine['context'] / 1024**3)}){verdict}",
        soft_wrap=True,
    )


def _print_strategies(con, rep: dict, budget) -> None:
    """Per GPU by strategy (and quantization): the estimate each would run with, against the
    budget, and which one the plan chose."""
    from rich.table import Table

    from jobs.memory import strategy_str
    from tune.plan import gib_str

    con.print(
        f"[bold]per GPU by strategy, {rep['num_workers']} worker(s)[/]"
        + ("" if budget is None else f", budget {gib_str(budget)}"),
        soft_wrap=True,
    )
    t = Table()
    for col in ("strategy", "base", "checkpointing", "per GPU", "budget", "plan"):
        t.add_column(col, justify="right" if col == "per GPU" else "left")
    for r in rep["strategies"]:
        verdict = "-" if r["fits"] is None else ("[green]fits[/]" if r["fits"] else "[red]exceeds[/]")
        base = rep["precision"] if r["quantization"] == "none" else r["quantization"]
        t.add_row(
            strategy_str(r["strategy"], r["reshard_after_forward"]),
            base,
            r["checkpointing"],
            gib_str(r["total_gib"]),
            verdict,
            "chosen" if r["chosen"] else "",
        )
    con.print(t)


# ---- tune --------------------------------------------------------------------------------


def cmd_tune(args) -> int:
    from jobs.data.sources import read_once
    from jobs.finetune import preflight
    from tune import storage
    from tune.plan import plan_search
    from tune.spec import load_search_spec

    raw = load_search_spec(args.spec, args.overrides)
    storage.check(raw)  # an object-store run.output_dir: the credentials, the bucket, the prefix, asked first
    with read_once():  # the count pass's parsed lines are the build's (`_run_tune`), which drops them
        preflight(raw)
        plan = plan_search(raw, args.spec)  # refuses an impossible budget before anything starts
        if args.plan:
            _print_plan(plan)
            return 0
        return _run_tune(args, raw, plan)


def _run_tune(args, raw, plan) -> int:
    """The search, run (or resumed) and reported; a search into a store holds its prefix throughout
    and is uploaded when it returns (`tune.storage`)."""
    from jobs.finetune import build_data
    from jobs.spec import absolutize
    from tune import storage
    from tune.run import check_resume, run_search  # Ray: only when the search runs
    from tune.spec import SearchSpec

    # Workers run elsewhere (another cwd): absolute paths for them, the user's paths for best.yaml.
    job = absolutize(raw.job())
    spec = SearchSpec.model_validate(job.to_dict() | {"search": raw.search.model_dump(mode="json")})
    resume = True if args.resume else (False if args.fresh else None)
    with storage.held(spec, fresh=args.fresh):
        check_resume(spec, raw, resume, args.spec)  # a refusal is one line, before anything is printed or started
        # The trials' one cache entry (the data keys are the same in every trial), built here: a refusal
        # of the data is one line before --fresh moves a local search, and no trial tokenizes.
        build_data(job)
        _fresh_local(spec, args.fresh)
        _print_plan(plan)
        with storage.syncing(spec):  # a search into a bucket: uploaded as it runs, results.json last by push
            outcome = run_search(
                spec, raw, plan, resume=resume, address=args.address, num_cpus=args.num_cpus, spec_path=args.spec
            )
        storage.push(spec)
    return _report(outcome, raw, plan, spec.output_location)


def _fresh_local(spec: JobSpec, fresh: bool) -> None:
    """`--fresh` on a local run.output_dir: the previous search moved aside (a store's staging
    directory was, before its lock was taken: `tune.storage.held`)."""
    from jobs.run.outputs import set_aside
    from jobs.run.storage import is_uri

    if not fresh or is_uri(spec.output_location):
        return
    moved = set_aside(spec.output_path)
    if moved:
        print(f"--fresh: the previous search was moved to {moved}", file=sys.stderr)


def _report(outcome, raw, plan, location: str) -> int:
    """The results table, the files and the best trial; the exit code."""
    from rich.console import Console

    from jobs.run.storage import is_uri
    from orchestrator.cli import EXIT_INTERRUPTED
    from orchestrator.cli.output import say
    from tune.report import results_table

    con = Console()
    if not con.is_terminal:
        con = Console(width=200)  # a log file: do not fold the table into 80 columns
    con.print(results_table(outcome.rows, raw.name, plan))
    for n in outcome.notes:
        con.print(f"note: {n}")
    for kind, path in outcome.files.items():
        con.print(f"{kind}: {path}")
    if is_uri(location):
        con.print(f"uploaded: {location} (results.json last)", soft_wrap=True)
    if outcome.interrupted:
        say("search interrupted; rerun the same command to resume (finished trials are kept)")
        return EXIT_INTERRUPTED
    if outcome.best is None:
        say("no trial finished, so there is no best.yaml (see results.csv for why)")
        return 1
    b = outcome.best
    con.print(
        f"best: trial {b['trial_id']}: micro {b['micro_batch_size']} x accum {b['grad_accum_steps']}, "
        f"lr {b['base_lr']:.3g} ({b['lr_scaling']}), {_best_value(plan, b)} -> {outcome.files['best']}"
    )
    return 0


def _best_value(plan, b: dict) -> str:
    """SFT (and any eval-loss search): `eval loss 1.2345`; with beta and another metric:
    `beta 0.1, eval_rewards/accuracies 0.7500 (highest; eval_loss 0.6931)`."""
    from tune.report import value_str

    beta = "" if b.get("beta") is None else f"beta {b['beta']:g}, "
    beta += "" if b.get("num_generations") is None else f"num_generations {b['num_generations']}, "
    return beta + (f"eval loss {b['eval_loss']:.4f}" if plan.metric == "eval_loss" else value_str(plan, b))


def _print_plan(plan) -> None:
    from jobs.memory import checkpointing_str
    from tune.plan import gib_str

    out = sys.stderr
    best = "" if plan.metric == "eval_loss" else f"; trials compared on {plan.metric} ({plan.mode})"
    print(
        f"plan: budget {gib_str(plan.budget_gib)} on {plan.device}; {plan.samples_per_trial} samples per trial, "
        f"eval every {plan.eval_every_samples} samples{best}",
        file=out,
    )
    for p in plan.points:
        est = "-" if p.estimate_gib is None else gib_str(p.estimate_gib)
        ck = checkpointing_str(p.checkpoint_every_n_layers)
        beta = "" if p.beta is None else f"beta {p.beta:<6g}, "
        beta += "" if p.num_generations is None else f"num_generations {p.num_generations:<3}, "
        print(
            f"  {p.status:10} micro {p.micro_batch_size or '-':>3} x accum {p.grad_accum_steps:>3} = global "
            f"{p.global_batch_size:>4}, lr_scaling {p.lr_scaling:6}, {beta}{p.strategy or '-'}, checkpointing {ck}, "
            f"estimate {est}" + (f"  ({p.reason})" if p.reason else ""),
            file=out,
        )
    for n in plan.notes:
        print(f"  note: {n}", file=out)
    out.flush()
