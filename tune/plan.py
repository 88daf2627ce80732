"""The search plan: every configuration of a search spec, judged against the memory budget
before anything starts. Pure: no Ray, no model weights, no files written.

`plan_search` expands the `search` section into points (micro-batch, accumulation, global
batch, lr rule, `objective.beta` where `search.beta` lists values, `rollout.num_generations`
where `search.num_generations` does) and gives each (micro-batch, beta) the
`jobs.memory.MemoryPlan` its trials will run: `plan_for_spec` on the base job
with the search budget as `memory.budget_gib`, the same call (same spec fields, same budget) a
trial's worker makes through `jobs.train.loop.memory_plan`. So the strategy (`resources.strategy:
auto`: DDP when it fits, else FSDP) and the checkpointing a point is judged with
(`memory.gradient_checkpointing`: true, false, or auto = off when that fits, else the sparsest
every-k-th-layer checkpointing that fits) is the one its trial uses, and the estimate is that
plan (a preference objective's beta changes no memory; GRPO's beta > 0 adds the reference
forward that beta 0 skips). Each point is marked:

* `planned`: launched, `search.num_samples` times with log-uniform base learning rates;
* `infeasible`: the plan's estimate exceeds the budget -- never launched, listed with its estimate;
* `skipped`: cannot be run as asked (not divisible -- a `num_generations` that does not divide
  the point's global batch of completions included --, same run as another point), with why.

A budget below the smallest possible job (micro-batch 1 with checkpointing) is refused
before anything starts, naming the smallest budget that fits.

Fair comparison (ASHA on `search.metric` at equal tokens: the eval loss, lowest wins, the
held-out preference accuracy `eval_rewards/accuracies` or GRPO's held-out mean reward
`eval_reward`, highest wins; `Plan.metric`,
`Plan.mode`). Every trial runs the same number of training samples
(`search.samples_per_trial`; max_steps = samples / global batch) and evaluates at the same
sample counts (`eval_every_samples`). ASHA's time attribute is
`samples_seen`. rayft's sample order does not depend on the global batch (step k takes
samples [k*G, (k+1)*G) of one seeded permutation per epoch), so equal samples seen means the
very same sequences, hence the same tokens, whatever the batch size.

`trial_job_dict` turns a point into the job spec one trial runs; `tune.run` launches them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jobs import memory
from jobs.errors import SpecError
from jobs.memory import checkpointing_str
from jobs.spec import JobSpec

from .spec import Rule, SearchSpec

# What a search leaves in run.output_dir (see tune.report for the results files).
TUNE_DIR = "tune"  # the Tune experiment (Tuner.restore path)
TRIALS_DIR = "trials"  # one job output dir per trial: trials/<trial_id>/
PLAN_FILE = "search_plan.json"  # this plan and the spec fingerprint (what a resume is checked against)
STATUS_FILE = "status.json"  # a trial's own verdict: finished / oom / error
STARTS_FILE = "starts.log"  # one line per time a trial function started
TIME_ATTR = "samples_seen"  # ASHA's time attribute: training samples, not steps


def gib_str(x: float | None) -> str:
    """GiB for people: MiB below 1 GiB (tiny models live there)."""
    if x is None:
        return "-"
    return f"{x * 1024:.2f} MiB" if x < 1 else f"{x:.2f} GiB"


def smallest_budget_str(gib: float) -> str:
    """Round *up* to 4 significant digits: a budget of exactly this number fits."""
    if gib <= 0:
        return "0"
    digits = 3 - int(math.floor(math.log10(gib)))
    q = 10**digits
    return f"{math.ceil(gib * q) / q:.{max(digits, 0)}f}"


# ---- plan --------------------------------------------------------------------------------


@dataclass
class Point:
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    lr_scaling: str
    reference_batch_size: int
    status: str = "planned"  # planned | infeasible | skipped
    reason: str = ""
    gradient_checkpointing: bool | None = None
    checkpoint_every_n_layers: int | None = None  # the plan's: 0 off, 1 every layer, k every k-th layer
    estimate_gib: float | None = None  # the plan's estimate (the least memory there is when infeasible)
    strategy: str | None = None  # the plan's: "ddp" or "fsdp" (resources.strategy auto decides per point)
    reshard_after_forward: bool | None = None  # the plan's, under fsdp
    estimate_off_gib: float | None = None  # checkpointing off, for the report
    estimate_on_gib: float | None = None  # checkpointing every layer, for the report
    max_steps: int | None = None
    every_steps: int | None = None
    beta: float | None = None  # the trial's objective.beta (search.beta); None: the base job's
    num_generations: int | None = None  # the trial's rollout.num_generations (search.num_generations)

    @property
    def key(self) -> str:
        beta = "" if self.beta is None else f"-b{self.beta:g}"
        gens = "" if self.num_generations is None else f"-g{self.num_generations}"
        return f"m{self.micro_batch_size}-a{self.grad_accum_steps}-{self.lr_scaling}{beta}{gens}"

    def trial_config(self) -> dict:
        """What Tune gets per grid point (the lr is sampled beside it)."""
        return {k: v for k, v in asdict(self).items() if k not in ("status", "reason")} | {"key": self.key}


@dataclass
class Plan:
    device: str
    budget_gib: float
    smallest_budget_gib: float
    samples_per_trial: int
    eval_every_samples: int
    grace_samples: int
    points: list[Point]
    notes: list[str] = field(default_factory=list)
    memory: dict[int, dict] = field(default_factory=dict)  # micro -> {off, on} GiB, for the plot
    job: dict = field(default_factory=dict, repr=False)  # the base job every trial starts from
    metric: str = "eval_loss"  # what trials are compared on (search.metric)
    mode: str = "min"  # "min" or "max": the best trial's value of `metric`
    base_beta: float | None = None  # the base job's objective.beta as it trains; None: no beta (SFT)
    base_generations: int | None = None  # the base job's rollout.num_generations; None: not GRPO

    @property
    def has_beta(self) -> bool:
        """The objective takes a beta: the report shows each trial's."""
        return self.base_beta is not None

    @property
    def has_generations(self) -> bool:
        """The objective samples completions (GRPO): the report shows each trial's num_generations."""
        return self.base_generations is not None

    def beta_of(self, point: dict) -> float | None:
        """The beta a trial of `point` trains with: its own (search.beta), else the base job's; None for SFT."""
        return point["beta"] if point.get("beta") is not None else self.base_beta

    def generations_of(self, point: dict) -> int | None:
        """The num_generations a trial of `point` samples: its own, else the base job's; None: not GRPO."""
        return point.get("num_generations") or self.base_generations

    @property
    def planned(self) -> list[Point]:
        return [p for p in self.points if p.status == "planned"]

    def trial_spec(self, point: dict, lr: float, out_dir: str = "", name: str | None = None) -> JobSpec:
        """The job spec a trial of `point` (a `Point.trial_config()`) with base lr `lr` runs."""
        return JobSpec.model_validate(
            trial_job_dict(self.job, point, lr, out_dir, name or self.job["name"], self.budget_gib)
        )

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "budget_gib": self.budget_gib,
            "smallest_budget_gib": self.smallest_budget_gib,
            "samples_per_trial": self.samples_per_trial,
            "eval_every_samples": self.eval_every_samples,
            "grace_samples": self.grace_samples,
            "notes": self.notes,
            "metric": self.metric,
            "mode": self.mode,
            "memory": {str(k): v for k, v in self.memory.items()},
            "points": [asdict(p) | {"key": p.key} for p in self.points],
        }


def _splits(spec: SearchSpec, notes: list[str]) -> tuple[list[tuple[int, int, int, str]], list[Rule], int]:
    """(micro, accum, global, why not) per batch split, the lr rules to search, the reference batch."""
    s = spec.search
    W = spec.resources.num_workers
    G0 = spec.batch.global_batch_size
    # The base job's global batch anchors the lr rule: lr = base x f(global / reference).
    reference = spec.optim.reference_batch_size or G0
    rules = list(s.lr_scaling)
    if s.mode == "fixed_global_batch":
        splits = []
        for a in s.grad_accum_steps:
            if G0 % (a * W):
                splits.append(
                    (
                        0,
                        a,
                        G0,
                        f"batch.global_batch_size={G0} is not divisible by grad_accum_steps={a} "
                        f"x resources.num_workers={W}",
                    )
                )
            else:
                splits.append((G0 // (a * W), a, G0, ""))
        if reference == G0 and len(rules) > 1:
            # Every trial has global batch == reference batch: f(1) = 1 for every rule.
            notes.append(
                f"lr_scaling {', '.join(rules[1:])}: same run as {rules[0]} in fixed_global_batch mode "
                f"(every trial's global batch {G0} equals the reference batch {reference}); searched once"
            )
            rules = rules[:1]
    else:
        micros = s.micro_batch_size or [spec.batch.micro_batch_size]
        splits = [(m, a, m * a * W, "") for m in micros for a in s.grad_accum_steps]
    return splits, rules, reference


def plan_search(spec: SearchSpec, where: str = "spec") -> Plan:
    """Every point of `spec` with its status, memory plan and cadence. Raises `SpecError` (prefixed
    with `where`, the spec's path) for a budget below micro-batch 1 or when no point can run."""
    s = spec.search
    notes: list[str] = []
    splits, rules, reference = _splits(spec, notes)
    points = _points(spec, splits, rules, reference)
    job_dict = spec.job_dict()
    mem, smallest = _judge_memory(spec, job_dict, points, where)
    every, grace = _cadence(spec, points, where)
    if not any(p.status == "planned" for p in points):
        reasons = sorted({f"{p.key}: {p.reason}" for p in points})
        raise SpecError(
            f"{where}: search: no configuration can run under {_budget_key(spec)}={spec.budget:g} "
            f"({'; '.join(reasons)})"
        )
    return Plan(
        device=spec.planned_device,
        budget_gib=spec.budget,
        smallest_budget_gib=smallest,
        samples_per_trial=s.samples_per_trial,
        eval_every_samples=every,
        grace_samples=grace,
        points=points,
        notes=notes,
        memory=mem,
        job=job_dict,
        metric=s.metric_name,
        mode=s.mode_of_metric,
        base_beta=spec.objective.value("beta"),
        base_generations=spec.rollout.num_generations if spec.rollout is not None else None,
    )


def _budget_key(spec: SearchSpec) -> str:
    """The key the budget came from, for messages."""
    return "search.budget_gib" if spec.search.budget_gib is not None else "memory.budget_gib"


def _points(
    spec: SearchSpec, splits: list[tuple[int, int, int, str]], rules: list[Rule], reference: int
) -> list[Point]:
    """The batch splits x the lr rules x the variants (beta, num_generations), each `planned` or
    `skipped` with why. A split that cannot run is listed once, not once per rule and variant."""
    variants = _variants(spec)
    points: list[Point] = []
    for m, a, g, why in splits:
        for i, rule in enumerate(rules[:1] if why else rules):
            for beta, gens in variants[:1] if why else variants:
                p = Point(m, a, g, rule, reference, beta=beta, num_generations=gens)
                reason = why or _why_not(spec, p, rules, i)
                if reason:
                    p.status, p.reason = "skipped", reason
                points.append(p)
    return points


def _variants(spec: SearchSpec) -> list[tuple[float | None, int | None]]:
    """(beta, num_generations) per point of a split: `search.beta` x `search.num_generations`,
    None where not searched (the base job's)."""
    s = spec.search
    betas: list[float | None] = list(s.beta) if s.beta else [None]
    gens: list[int | None] = list(s.num_generations) if s.num_generations else [None]
    return [(b, n) for b in betas for n in gens]


def _why_not(spec: SearchSpec, p: Point, rules: list[Rule], i: int) -> str:
    """Why point `p` (lr rule number `i` of `rules`) is not run, or "" when it is."""
    s, g = spec.search, p.global_batch_size
    if i and g == p.reference_batch_size:
        return (
            f"same run as lr_scaling={rules[0]}: the global batch {g} is the reference batch, "
            "where every rule gives the base lr"
        )
    if s.samples_per_trial % g:
        return (
            f"search.samples_per_trial={s.samples_per_trial} is not a multiple of the global batch {g} "
            "(every trial sees the same samples)"
        )
    if p.num_generations is not None and g % p.num_generations:
        return (
            f"the global batch {g} (completions) is not a multiple of num_generations={p.num_generations} "
            "(every prompt's group is whole in one step)"
        )
    return ""


def _judge_memory(spec: SearchSpec, job_dict: dict, points: list[Point], where: str) -> tuple[dict[int, dict], float]:
    """Give each point the `MemoryPlan` of its micro-batch and beta, as the trials' workers will make
    it, and mark the planned ones whose estimate exceeds the budget `infeasible` (`job_dict`: the base
    job, `spec.job_dict()`, which the plan also keeps). Returns the estimates per micro-batch
    (checkpointing off and on, the base job's) and the smallest job's (micro-batch 1); refuses a
    budget below that."""
    device, budget = spec.planned_device, spec.budget  # the estimate is for the device the trials run on
    try:
        # A trial's spec carries the search budget as memory.budget_gib (trial_job_dict): plan with it.
        base = _budget_job(job_dict, budget, None)
        config = memory.config_from_spec(base)
        plans = _plans(job_dict, budget, points, device, config)
        mem = {m: _off_on(base, m, device, config) for m in sorted({k[0] for k in plans})}
        smallest = min(_smallest(job, spec, device, config) for job in _variant_jobs(job_dict, budget, points))
    except ValueError as e:  # SpecError included: the field it names, prefixed with the spec's path
        raise SpecError(f"{where}: {e}") from None
    _refuse_below_smallest(spec, budget, smallest, device, where)
    for p in points:
        if p.micro_batch_size:
            _judge_point(p, plans[p.micro_batch_size, p.beta], mem[p.micro_batch_size], budget)
    return mem, smallest


def _budget_job(job_dict: dict, budget: float, beta: float | None) -> JobSpec:
    """The base job at the search budget, with `beta` (a searched one) as its objective.beta."""
    d = json.loads(json.dumps(job_dict))
    d["memory"] = {**d["memory"], "budget_gib": budget}
    if beta is not None:
        d["objective"]["beta"] = beta
    return JobSpec.model_validate(d)


def _variant_jobs(job_dict: dict, budget: float, points: list[Point]) -> list[JobSpec]:
    """The budget job of every beta the points train with (one job when beta is not searched)."""
    return [_budget_job(job_dict, budget, b) for b in sorted({p.beta for p in points}, key=lambda b: b or 0)]


def _plans(job_dict: dict, budget: float, points: list[Point], device: str, config) -> dict:
    """The `MemoryPlan` of each (micro-batch, beta) the points use."""
    jobs = {b: _budget_job(job_dict, budget, b) for b in {p.beta for p in points}}
    keys = {(p.micro_batch_size, p.beta) for p in points if p.micro_batch_size}
    return {(m, b): memory.plan_for_spec(jobs[b], device=device, micro_batch_size=m, config=config) for m, b in keys}


def _off_on(job: JobSpec, micro: int, device: str, config) -> dict:
    """The estimate of `micro` with checkpointing off and on (the report's plot)."""
    return {
        k: memory.estimate_for_spec(
            job, micro_batch_size=micro, gradient_checkpointing=gc, device=device, config=config
        ).total_gib
        for k, gc in (("off", False), ("on", True))
    }


def _smallest(job: JobSpec, spec: SearchSpec, device: str, config) -> float:
    """The estimate of micro-batch 1 with checkpointing (unless it is off): the least memory a trial takes."""
    gc = spec.memory.gradient_checkpointing is not False
    return memory.estimate_for_spec(
        job, micro_batch_size=1, gradient_checkpointing=gc, device=device, config=config
    ).total_gib


def _refuse_below_smallest(spec: SearchSpec, budget: float, smallest: float, device: str, where: str) -> None:
    if budget >= smallest:
        return
    gc_mode = spec.memory.gradient_checkpointing
    how = "with gradient checkpointing" if gc_mode is not False else "(memory.gradient_checkpointing=false)"
    raise SpecError(
        f"{where}: {_budget_key(spec)}={budget:g} is too small: even micro_batch_size=1 {how} needs "
        f"{gib_str(smallest)} on {device} (jobs.memory estimate); the smallest budget that fits is "
        f"{smallest_budget_str(smallest)} GiB"
    )


def _judge_point(p: Point, mp: memory.MemoryPlan, mem: dict, budget: float) -> None:
    """Point `p` gets its plan's strategy, checkpointing and estimate; `infeasible` when it does not fit."""
    p.estimate_off_gib, p.estimate_on_gib = mem["off"], mem["on"]
    p.checkpoint_every_n_layers, p.estimate_gib = mp.checkpoint_every_n_layers, mp.total_gib
    p.strategy, p.reshard_after_forward = mp.strategy, mp.reshard_after_forward
    p.gradient_checkpointing = mp.checkpoint_every_n_layers > 0
    if p.status == "planned" and not mp.fits:
        p.status = "infeasible"
        p.reason = (
            f"estimate {gib_str(p.estimate_gib)} > budget {gib_str(budget)} "
            f"({mp.strategy_str}, checkpointing {mp.checkpointing})"
        )


def _cadence(spec: SearchSpec, points: list[Point], where: str) -> tuple[int, int]:
    """The eval/report interval and ASHA's grace, in samples, the same for every trial; sets each
    planned point's `max_steps` and `every_steps`. Returns (interval, grace)."""
    s = spec.search
    live = [p for p in points if p.status == "planned"]  # feasible: infeasible points do not constrain it
    if s.eval_every_samples is not None:
        every = s.eval_every_samples
        for p in live:
            if every % p.global_batch_size:
                p.status, p.reason = (
                    "skipped",
                    (
                        f"search.eval_every_samples={every} is not a multiple of the global "
                        f"batch {p.global_batch_size} (trials report at equal samples seen)"
                    ),
                )
    else:
        # Each global batch divides samples_per_trial, so their lcm does too.
        every = math.lcm(*(p.global_batch_size for p in live)) if live else s.samples_per_trial
    grace = s.asha.grace_samples or every
    if grace % every:
        raise SpecError(
            f"{where}: search.asha.grace_samples={grace} is not a multiple of the eval interval "
            f"{every} samples (set search.eval_every_samples)"
        )
    for p in points:
        if p.status == "planned":
            p.max_steps = s.samples_per_trial // p.global_batch_size
            p.every_steps = every // p.global_batch_size
    return every, grace


# ---- one trial's job ---------------------------------------------------------------------


def trial_job_dict(base: dict, p: dict, lr: float, out_dir: str, name: str, budget_gib: float) -> dict:
    """The JobSpec of one trial: the base job with this point's split, lr, rule and cadence."""
    d = json.loads(json.dumps(base))
    d["name"] = name
    d["batch"] = {
        "global_batch_size": p["global_batch_size"],
        "micro_batch_size": p["micro_batch_size"],
        "grad_accum_steps": p["grad_accum_steps"],
    }
    d["optim"].update(lr=float(lr), lr_scaling=p["lr_scaling"], reference_batch_size=p["reference_batch_size"])
    if p.get("beta") is not None:
        d["objective"]["beta"] = float(p["beta"])
    if p.get("num_generations") is not None:
        d["rollout"]["num_generations"] = int(p["num_generations"])
    # `auto` stays `auto`: under the same budget the trial's worker makes the very MemoryPlan
    # (`jobs.memory.plan_for_spec`) this point was judged with, selective every-k included.
    gc = "auto" if d["memory"].get("gradient_checkpointing") == "auto" else bool(p["gradient_checkpointing"])
    d["memory"].update(gradient_checkpointing=gc, budget_gib=budget_gib)
    # max_failures=0: out of memory is an answer, not a retry (tune.run records it as infeasible).
    d["run"].update(
        max_steps=p["max_steps"],
        epochs=None,
        checkpoint_every=p["every_steps"],
        eval_every=p["every_steps"],
        keep_checkpoints=1,
        max_failures=0,
        output_dir=out_dir,
    )
    # Trials write to <search output>/trials/<id>: their shared tokenized data goes beside trials/,
    # in the search's own output dir, not among the trial directories.
    if not d["data"].get("cache_dir"):
        d["data"]["cache_dir"] = str(Path(out_dir).parent.parent / ".rayft-data")
    return d


def trial_name(base_name: str, trial_id: str) -> str:
    """The trial's job name: the search's, cut so that the suffix fits a 63-character DNS label."""
    suffix = trial_id.replace("_", "-").lower()
    return f"{base_name[: 62 - len(suffix)].rstrip('-')}-{suffix}"


def describe(p: dict, lr: float) -> str:
    """One trial, for a log line."""
    beta = "" if p.get("beta") is None else f"beta {p['beta']:g}, "
    beta += "" if p.get("num_generations") is None else f"num_generations {p['num_generations']}, "
    return (
        f"micro {p['micro_batch_size']} x accum {p['grad_accum_steps']} (global {p['global_batch_size']}), "
        f"lr {lr:.3g} {p['lr_scaling']}, {beta}{p.get('strategy') or 'ddp'}, "
        f"checkpointing {checkpointing_str(p.get('checkpoint_every_n_layers'))}"
    )


def spec_fingerprint(spec: SearchSpec) -> str:
    """What a resume is checked against: the whole search spec, as the user wrote it."""
    d = spec.model_dump(mode="json")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
