"""The search: plan every configuration against the memory budget, then run the feasible
ones as Ray Tune trials, each a Ray Train TorchTrainer (Train v2 inside a Tune function
trainable).

Planning (`plan_search`) is pure and starts nothing. It expands the `search` section into
points (micro-batch, accumulation, global batch, lr rule), estimates each point's memory
with `jobs.memory` for the device the trials run on, decides checkpointing
(`memory.gradient_checkpointing`: true, false, or auto = off when that fits, else the sparsest
every-k-th-layer checkpointing that fits, as `jobs.memory.choose_checkpointing` decides for the
trial itself) and
marks points:

* `planned`: launched, `search.num_samples` times with log-uniform base learning rates;
* `infeasible`: the estimate exceeds the budget -- never launched, listed with its estimate;
* `skipped`: cannot be run as asked (not divisible, same run as another point), with why.

A budget below the smallest possible job (micro-batch 1 with checkpointing) is refused
before anything starts, naming the smallest budget that fits.

Fair comparison (ASHA on eval loss at equal tokens). Every trial runs the same number of
training samples (`search.samples_per_trial`; max_steps = samples / global batch) and
evaluates at the same sample counts (`eval_every_samples`). ASHA's time attribute is
`samples_seen`. rayft's sample order does not depend on the global batch (step k takes
samples [k*G, (k+1)*G) of one seeded permutation per epoch), so equal samples seen means the
very same sequences, hence the same tokens, whatever the batch size.

Each trial's Train run has `FailureConfig(max_failures=0)` and Tune's failure config does
not retry either: a trial that still runs out of memory is recorded as infeasible (its
`status.json` says so) and the search goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from jobs.memory import checkpointing_str
from jobs.spec import JobSpec, SpecError
from .spec import SearchSpec, lcm

log = logging.getLogger("rayft")

TUNE_DIR = "tune"  # the Tune experiment (Tuner.restore path) inside run.output_dir
TRIALS_DIR = "trials"  # one job output dir per trial: trials/<trial_id>/
PLAN_FILE = "search_plan.json"
STATUS_FILE = "status.json"
STARTS_FILE = "starts.log"
TIME_ATTR = "samples_seen"
METRIC = "eval_loss"


def gib_str(x: Optional[float]) -> str:
    """GiB for people: MiB below 1 GiB (tiny models live there)."""
    if x is None:
        return "-"
    return f"{x * 1024:.2f} MiB" if x < 1 else f"{x:.2f} GiB"


def smallest_budget_str(x: float) -> str:
    """Round *up* to 4 significant digits: a budget of exactly this number fits."""
    if x <= 0:
        return "0"
    digits = 3 - int(math.floor(math.log10(x)))
    q = 10 ** digits
    return f"{math.ceil(x * q) / q:.{max(digits, 0)}f}"


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
    gradient_checkpointing: Optional[bool] = None
    checkpoint_every_n_layers: Optional[int] = None  # 0 off, 1 every layer, k selective (auto mode)
    estimate_gib: Optional[float] = None  # for the checkpointing choice (the lower one when infeasible)
    estimate_off_gib: Optional[float] = None
    estimate_on_gib: Optional[float] = None
    max_steps: Optional[int] = None
    every_steps: Optional[int] = None

    @property
    def key(self) -> str:
        return f"m{self.micro_batch_size}-a{self.grad_accum_steps}-{self.lr_scaling}"

    @property
    def lr_scale(self) -> float:
        x = self.global_batch_size / self.reference_batch_size
        return {"none": 1.0, "linear": x, "sqrt": math.sqrt(x)}[self.lr_scaling]

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

    @property
    def planned(self) -> list[Point]:
        return [p for p in self.points if p.status == "planned"]

    def to_dict(self) -> dict:
        return {"device": self.device, "budget_gib": self.budget_gib, "smallest_budget_gib": self.smallest_budget_gib,
                "samples_per_trial": self.samples_per_trial, "eval_every_samples": self.eval_every_samples,
                "grace_samples": self.grace_samples, "notes": self.notes,
                "memory": {str(k): v for k, v in self.memory.items()},
                "points": [asdict(p) | {"key": p.key} for p in self.points]}


def trial_device(spec: JobSpec) -> str:
    """The estimate is for the device the trials run on: cuda with resources.use_gpu, else cpu."""
    return "cuda" if spec.resources.use_gpu else "cpu"


def plan_search(spec: SearchSpec, where: str = "spec") -> Plan:
    from jobs import memory

    s = spec.search
    job = spec.job()
    W = spec.resources.num_workers
    G0 = spec.batch.global_batch_size
    device = trial_device(spec)
    budget = spec.budget
    notes: list[str] = []

    # -- points: the batch split --
    splits: list[tuple[int, int, int, str]] = []  # micro, accum, global, skip reason
    if s.mode == "fixed_global_batch":
        reference = spec.optim.reference_batch_size or G0
        for a in s.grad_accum_steps:
            if G0 % (a * W):
                splits.append((0, a, G0, f"batch.global_batch_size={G0} is not divisible by grad_accum_steps={a} "
                                         f"x resources.num_workers={W}"))
            else:
                splits.append((G0 // (a * W), a, G0, ""))
        rules = list(s.lr_scaling)
        if reference == G0 and len(rules) > 1:
            # Every trial has global batch == reference batch: f(1) = 1 for every rule.
            notes.append(f"lr_scaling {', '.join(rules[1:])}: same run as {rules[0]} in fixed_global_batch mode "
                         f"(every trial's global batch {G0} equals the reference batch {reference}); searched once")
            rules = rules[:1]
    else:
        # The base job's global batch anchors the lr rule: lr = base x f(global / reference).
        reference = spec.optim.reference_batch_size or G0
        micros = s.micro_batch_size or [spec.batch.micro_batch_size]
        splits = [(m, a, m * a * W, "") for m in micros for a in s.grad_accum_steps]
        rules = list(s.lr_scaling)

    points: list[Point] = []
    for m, a, g, why in splits:
        for i, rule in enumerate(rules[:1] if why else rules):  # a split that cannot run is listed once
            p = Point(m, a, g, rule, reference)
            if why:
                p.status, p.reason = "skipped", why
            elif i and g == reference:
                p.status, p.reason = "skipped", (f"same run as lr_scaling={rules[0]}: the global batch {g} is the "
                                                 "reference batch, where every rule gives the base lr")
            elif s.samples_per_trial % g:
                p.status, p.reason = "skipped", (f"search.samples_per_trial={s.samples_per_trial} is not a multiple "
                                                 f"of the global batch {g} (every trial sees the same samples)")
            points.append(p)

    # -- memory: estimate every micro-batch once, off and on --
    try:
        config = memory.config_from_spec(job)
        mem: dict[int, dict] = {}
        for m in sorted({p.micro_batch_size for p in points if p.micro_batch_size}):
            off = memory.estimate_for_spec(job, micro_batch_size=m, gradient_checkpointing=False, device=device,
                                           config=config).total_gib
            on = memory.estimate_for_spec(job, micro_batch_size=m, gradient_checkpointing=True, device=device,
                                          config=config).total_gib
            mem[m] = {"off": off, "on": on}
            if spec.memory.gradient_checkpointing == "auto":
                # what the trial's own `auto` will pick: off, else the sparsest every-k that fits
                mem[m]["every"], mem[m]["auto"] = memory.choose_checkpointing(
                    job, budget, device=device, config=config, micro_batch_size=m)
        gc_mode = spec.memory.gradient_checkpointing
        smallest = memory.estimate_for_spec(job, micro_batch_size=1, gradient_checkpointing=gc_mode is not False,
                                            device=device, config=config).total_gib
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None

    budget_key = "search.budget_gib" if s.budget_gib is not None else "memory.budget_gib"
    if budget < smallest:
        how = "with gradient checkpointing" if gc_mode is not False else "(memory.gradient_checkpointing=false)"
        raise SpecError(
            f"{where}: {budget_key}={budget:g} is too small: even micro_batch_size=1 {how} needs "
            f"{gib_str(smallest)} on {device} (jobs.memory estimate); the smallest budget that fits is "
            f"{smallest_budget_str(smallest)} GiB")

    for p in points:
        if not p.micro_batch_size:
            continue
        e = mem[p.micro_batch_size]
        p.estimate_off_gib, p.estimate_on_gib = e["off"], e["on"]
        if gc_mode == "auto":
            p.checkpoint_every_n_layers, p.estimate_gib = e["every"], e["auto"]
            p.gradient_checkpointing = e["every"] > 0
        else:
            p.gradient_checkpointing = bool(gc_mode)
            p.checkpoint_every_n_layers = int(p.gradient_checkpointing)
            p.estimate_gib = e["on"] if p.gradient_checkpointing else e["off"]
        if p.status == "planned" and p.estimate_gib > budget:
            p.status = "infeasible"
            p.reason = (f"estimate {gib_str(p.estimate_gib)} > budget {gib_str(budget)} "
                        f"(checkpointing {checkpointing_str(p.checkpoint_every_n_layers)})")

    # -- the eval/report interval: the same sample counts for every trial --
    live = [p for p in points if p.status == "planned"]  # feasible: infeasible points do not constrain it
    if s.eval_every_samples is not None:
        every = s.eval_every_samples
        for p in live:
            if every % p.global_batch_size:
                p.status, p.reason = "skipped", (f"search.eval_every_samples={every} is not a multiple of the global "
                                                 f"batch {p.global_batch_size} (trials report at equal samples seen)")
    else:
        # Each global batch divides samples_per_trial, so their lcm does too.
        every = lcm(p.global_batch_size for p in live) if live else s.samples_per_trial
    grace = s.asha.grace_samples or every
    if grace % every:
        raise SpecError(f"{where}: search.asha.grace_samples={grace} is not a multiple of the eval interval "
                        f"{every} samples (set search.eval_every_samples)")

    for p in points:
        if p.status == "planned":
            p.max_steps = s.samples_per_trial // p.global_batch_size
            p.every_steps = every // p.global_batch_size

    if not any(p.status == "planned" for p in points):
        reasons = sorted({f"{p.key}: {p.reason}" for p in points})
        raise SpecError(f"{where}: search: no configuration can run under {budget_key}={budget:g} ({'; '.join(reasons)})")
    return Plan(device=device, budget_gib=budget, smallest_budget_gib=smallest,
                samples_per_trial=s.samples_per_trial, eval_every_samples=every, grace_samples=grace,
                points=points, notes=notes, memory=mem)


# ---- one trial ---------------------------------------------------------------------------

def trial_job_dict(base: dict, p: dict, lr: float, out_dir: str, name: str, budget: float) -> dict:
    """The JobSpec of one trial: the base job with this point's split, lr, rule and cadence."""
    d = json.loads(json.dumps(base))
    d["name"] = name
    d["batch"] = {"global_batch_size": p["global_batch_size"], "micro_batch_size": p["micro_batch_size"],
                  "grad_accum_steps": p["grad_accum_steps"]}
    d["optim"].update(lr=float(lr), lr_scaling=p["lr_scaling"], reference_batch_size=p["reference_batch_size"])
    # `auto` stays `auto`: the trial decides through `jobs.memory.choose_checkpointing` under the
    # same budget, the choice its plan estimated (selective every-k included).
    gc = "auto" if d["memory"].get("gradient_checkpointing") == "auto" else bool(p["gradient_checkpointing"])
    d["memory"].update(gradient_checkpointing=gc, budget_gib=budget)
    d["run"].update(max_steps=p["max_steps"], epochs=None, checkpoint_every=p["every_steps"],
                    eval_every=p["every_steps"], keep_checkpoints=1, max_failures=0, output_dir=out_dir)
    return d


def trial_name(base_name: str, trial_id: str) -> str:
    suffix = trial_id.replace("_", "-").lower()
    return f"{base_name[: 62 - len(suffix)].rstrip('-')}-{suffix}"


class TrialOutOfMemory(RuntimeError):
    """A launched trial ran out of memory: recorded as infeasible, never retried."""


def oom_line(err: BaseException) -> Optional[str]:
    """The out-of-memory message inside a (Ray-wrapped) training failure, if that is what it is."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    found: Optional[str] = None
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        # Ray flattens remote tracebacks into the message: find the exception line in it.
        for line in str(e).splitlines():
            m = _OOM_LINE.search(line)
            if m:
                return m.group(0).strip()[:300]
            if found is None and "out of memory" in line.lower():
                found = line.strip()[:300]
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
        todo.extend([e.__cause__, e.__context__])
    return found


_OOM_LINE = re.compile(r"(\w+\.)*OutOfMemoryError: .*")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def forward_metrics(m: dict, global_batch: int, max_steps: int) -> Optional[dict]:
    """What one worker report becomes for Tune, or None to hold it back.

    `samples_seen` = optimizer steps x global batch: the ASHA time attribute. The final step is
    held back: the trial function reports it once the job has written its outputs, so an ASHA
    decision at the last rung can never cut the job off before summary.json and the adapter exist.
    Reports without an eval loss (there are none with the cadence the plan sets) are held back too.
    """
    step = m.get("step")
    if not step or step >= max_steps or m.get(METRIC) is None:
        return None
    return {TIME_ATTR: int(step) * global_batch, METRIC: float(m[METRIC]), "step": int(step),
            "loss": m.get("loss"), "tokens_per_s": m.get("tokens_per_s")}


def _make_forwarder(global_batch: int, max_steps: int):
    """A Ray Train UserCallback (it runs in the Train controller) that forwards rank 0's reports to
    the Tune session of the trial, as Ray's own `TuneReportCallback` does, through `forward_metrics`."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class ForwardToTune(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            out = forward_metrics(metrics[0], global_batch, max_steps)
            if out is None:
                return
            if checkpoint is not None:
                out["checkpoint_path"] = checkpoint.path
            self._training_actor_item_queue.put(out)

    return ForwardToTune()


def run_trial(config: dict, setup: dict) -> None:
    """Tune function trainable: one trial = one Ray Train TorchTrainer run of the trial's job."""
    import ray.train
    from ray import tune
    from ray.train.torch import TorchTrainer

    from jobs.launch import train_worker

    trial_id = tune.get_context().get_trial_id()
    p, lr = config["point"], float(config["lr"])
    out = Path(setup["trials_dir"]) / trial_id
    out.mkdir(parents=True, exist_ok=True)
    d = trial_job_dict(setup["job"], p, lr, str(out), trial_name(setup["name"], trial_id), setup["budget_gib"])
    spec = JobSpec.model_validate(d)
    _write_json(out / "trial.json", {"trial_id": trial_id, "point": p, "lr": lr,
                                     "effective_lr": spec.effective_lr, "spec": spec.to_dict()})

    status = read_json(out / STATUS_FILE)
    if status and status.get("status") == "oom":
        # Ran out of memory before an interruption the experiment state did not see: still infeasible.
        with open(out / STARTS_FILE, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} out of memory earlier: not rerun\n")
        raise TrialOutOfMemory(f"out of memory at micro_batch_size={p['micro_batch_size']} (recorded earlier, "
                               f"not retried): {status.get('error')}")
    if status and status.get("status") == "finished":
        # Finished before an interruption the experiment state did not see: report, don't retrain.
        with open(out / STARTS_FILE, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} already finished: not rerun\n")
        tune.report(status["result"])
        return
    if p["estimate_gib"] is None or p["estimate_gib"] > setup["budget_gib"]:  # the plan never lets this through
        raise RuntimeError(f"trial {p['key']} is over budget and must not run")
    with open(out / STARTS_FILE, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} train\n")

    r = spec.resources
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"spec": spec.to_dict(), "progress": None, "resume": True},
        scaling_config=ray.train.ScalingConfig(
            num_workers=r.num_workers, use_gpu=r.use_gpu, accelerator_type=r.accelerator_type,
            resources_per_worker={"CPU": r.cpus_per_worker, **({"GPU": 1} if r.use_gpu else {})}),
        run_config=ray.train.RunConfig(
            name="checkpoints",
            storage_path=str(out),
            failure_config=ray.train.FailureConfig(max_failures=0),  # out of memory is not retried
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            worker_runtime_env={"env_vars": dict(spec.run.env)} if spec.run.env else None,
            callbacks=[_make_forwarder(p["global_batch_size"], p["max_steps"])],
        ),
    )
    t0 = time.time()
    try:
        trainer.fit()
    except Exception as e:
        oom = oom_line(e)
        if oom:
            _write_json(out / STATUS_FILE, {"status": "oom", "error": oom, "wall_s": time.time() - t0})
            raise TrialOutOfMemory(f"out of memory at micro_batch_size={p['micro_batch_size']} "
                                   f"(estimate {gib_str(p['estimate_gib'])}): {oom}") from None
        _write_json(out / STATUS_FILE, {"status": "error", "error": f"{type(e).__name__}: {str(e)[:500]}"})
        raise
    summary = read_json(out / "summary.json") or {}
    result = {TIME_ATTR: p["max_steps"] * p["global_batch_size"], METRIC: summary.get("eval_loss"),
              "step": summary.get("steps"), "loss": summary.get("final_loss"),
              "tokens_per_s": summary.get("mean_tokens_per_s"), "tokens_seen": summary.get("tokens_seen"),
              "peak_mem_gib": summary.get("peak_mem_gib"), "finished": True}
    _write_json(out / STATUS_FILE, {"status": "finished", "result": result, "wall_s": time.time() - t0})
    tune.report(result)


def trial_dirname(trial) -> str:
    return trial.trial_id


def _describe(p: dict, lr: float) -> str:
    return (f"micro {p['micro_batch_size']} x accum {p['grad_accum_steps']} (global {p['global_batch_size']}), "
            f"lr {lr:.3g} {p['lr_scaling']}, checkpointing {checkpointing_str(p.get('checkpoint_every_n_layers'))}")


# ---- the driver --------------------------------------------------------------------------

def spec_fingerprint(spec: SearchSpec) -> str:
    d = spec.model_dump(mode="json")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def init_ray(address: Optional[str], num_cpus: Optional[int], per_trial_cpus: int) -> None:
    """A trial holds one CPU for the trial function and one per worker: on 2 cores two 1-worker
    trials need 4 logical CPUs."""
    from jobs.launch import init_ray as init

    init(address, num_cpus or max(os.cpu_count() or 1, 2 * per_trial_cpus), log_to_driver=False)


def concurrency(spec: SearchSpec, n_trials: int, notes: list[str]) -> int:
    """Trials at once: what the cluster holds (1 CPU for the trial function + the workers' CPUs/GPUs)."""
    import ray

    r = spec.resources
    per_cpu = 1 + math.ceil(r.num_workers * r.cpus_per_worker)
    res = ray.cluster_resources()
    fit = int(res.get("CPU", 0) // per_cpu)
    what = f"{res.get('CPU', 0):g} CPUs / {per_cpu} per trial"
    if r.use_gpu:
        fit = min(fit, int(res.get("GPU", 0) // r.num_workers))
        what += f", {res.get('GPU', 0):g} GPUs / {r.num_workers} per trial"
    if fit < 1:
        raise SpecError(f"resources.num_workers: the cluster cannot hold one trial ({what})")
    want = spec.search.max_concurrent_trials
    if want and want > fit:
        notes.append(f"search.max_concurrent_trials={want} capped at {fit}: the cluster holds {fit} trials ({what})")
    n = min(want or fit, fit, max(1, n_trials))
    notes.append(f"{n} trial(s) at a time ({what})")
    return n


@dataclass
class Outcome:
    rows: list[dict]
    best: Optional[dict]
    interrupted: bool
    resumed: bool
    files: dict[str, str]
    notes: list[str]


def check_resume(spec: SearchSpec, raw_spec: SearchSpec, resume: Optional[bool], spec_path: str = "spec") -> bool:
    """Whether this run resumes an earlier search in run.output_dir (`resume`: None = if there is
    one, True = there must be one, False = never). Refuses to resume a search whose spec changed."""
    from ray import tune

    out = spec.output_path
    exp = (out / TUNE_DIR).resolve()
    can = exp.exists() and tune.Tuner.can_restore(str(exp))
    if resume and not can:
        raise SpecError(f"{spec_path}: --resume: no interrupted search to resume in {exp}")
    if not can or resume is False:
        return False
    saved = read_json(out / PLAN_FILE) or {}
    if saved.get("fingerprint") != spec_fingerprint(raw_spec):
        diffs = _diff(saved.get("spec") or {}, raw_spec.model_dump(mode="json"))
        shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        raise SpecError(f"{spec_path}: cannot resume the search in {out}: the search spec changed since it "
                        f"started ({shown or 'unreadable search_plan.json'}); use --fresh to start over "
                        "(the old search is moved aside)")
    return True


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, `key: old -> new`."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def run_search(spec: SearchSpec, raw_spec: SearchSpec, plan: Plan, *, resume: Optional[bool] = None,
               address: Optional[str] = None, num_cpus: Optional[int] = None,
               spec_path: str = "spec") -> Outcome:
    """Run (or resume) the search. `spec` is absolutized for workers; `raw_spec` is what the user wrote
    (best.yaml keeps its relative paths). `resume`: None = if possible, True = must, False = fresh."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # rayft prints its own lines; verbose=0 then means quiet
    # Save the experiment state (trial statuses: what Tuner.restore resumes from) every 2 s instead
    # of Tune's adaptive >= 10 s: the state is a few KB, and a killed search then loses at most 2 s.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from . import report
    from .callbacks import Announce

    out = spec.output_path
    exp = (out / TUNE_DIR).resolve()
    fingerprint = spec_fingerprint(raw_spec)
    notes = list(plan.notes)
    resumed = check_resume(spec, raw_spec, resume, spec_path)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / PLAN_FILE, {"fingerprint": fingerprint, "spec": raw_spec.model_dump(mode="json"),
                                  "plan": plan.to_dict()})

    r = spec.resources
    per_trial = 1 + math.ceil(r.num_workers * r.cpus_per_worker)
    init_ray(address, num_cpus, per_trial)
    n_trials = len(plan.planned) * spec.search.num_samples
    max_conc = concurrency(spec, n_trials, notes)

    setup = {"job": spec.job_dict(), "trials_dir": str((out / TRIALS_DIR).resolve()), "budget_gib": plan.budget_gib,
             "name": spec.name}
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": 1})
    s = spec.search
    if resumed:
        print(f"resuming the search in {exp} (finished trials are not rerun)", file=sys.stderr, flush=True)
        tuner = tune.Tuner.restore(str(exp), trainable=trainable, resume_unfinished=True, resume_errored=False,
                                   restart_errored=False)
    else:
        lo, hi = (s.lr.low, s.lr.high) if s.lr else (spec.optim.lr, spec.optim.lr)
        lr_space = tune.loguniform(lo, hi) if hi > lo else lo
        scheduler = (ASHAScheduler(time_attr=TIME_ATTR, max_t=plan.samples_per_trial, grace_period=plan.grace_samples,
                                   reduction_factor=s.asha.reduction_factor)
                     if s.scheduler == "asha" else FIFOScheduler())
        seed = s.seed if s.seed is not None else spec.run.seed
        tuner = tune.Tuner(
            trainable,
            param_space={"point": tune.grid_search([p.trial_config() for p in plan.planned]), "lr": lr_space},
            tune_config=tune.TuneConfig(
                metric=METRIC, mode="min", scheduler=scheduler, num_samples=s.num_samples,
                # The concurrency limit goes to the generator: Tune ignores max_concurrent_trials when
                # a search_alg is passed, and a seeded generator is what makes the lr draws reproducible.
                search_alg=BasicVariantGenerator(max_concurrent=max_conc, random_state=seed),
                trial_dirname_creator=trial_dirname, reuse_actors=False),
            run_config=tune.RunConfig(
                name=TUNE_DIR, storage_path=str(out.resolve()), verbose=0,
                failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),  # never retried
                callbacks=[Announce()]),
        )
    print(f"search {spec.name}: {n_trials} trial(s) of {len(plan.points)} point(s) "
          f"({sum(p.status == 'infeasible' for p in plan.points)} infeasible, "
          f"{sum(p.status == 'skipped' for p in plan.points)} skipped); {notes[-1]}", file=sys.stderr, flush=True)
    tune_log = logging.getLogger("ray.tune.tune")
    level = tune_log.level
    tune_log.setLevel(logging.CRITICAL)  # "Trials did not complete": rayft reports failed trials itself
    try:
        grid = tuner.fit()
    finally:
        tune_log.setLevel(level)
    interrupted = grid.num_terminated + grid.num_errors < len(grid)
    rows = collect_rows(plan, grid, out)
    best = report.pick_best(rows, plan.samples_per_trial)
    files = report.write_all(out, raw_spec, plan, rows, best, notes, interrupted=interrupted)
    return Outcome(rows, best, interrupted, resumed, files, notes)


def collect_rows(plan: Plan, grid, out: Path) -> list[dict]:
    """One row per launched trial (from Tune's result grid and the trial's own files) and one per
    point that was never launched."""
    from jobs.outputs import read_metrics

    rows: list[dict] = []
    for res in grid:
        trial_id = Path(res.path).name
        tdir = out / TRIALS_DIR / trial_id
        # A trial restored from the experiment state without results has no config on its Result:
        # the trial's own record (or Tune's params.json) has it.
        cfg = res.config or read_json(tdir / "trial.json") or read_json(Path(res.path) / "params.json")
        if not cfg or "point" not in cfg:
            continue
        p = cfg["point"]
        lr = float(cfg["lr"])
        st = read_json(tdir / STATUS_FILE) or {}
        m = dict(res.metrics or {})
        samples = int(m.get(TIME_ATTR) or 0)
        # Tune's verdict first: a trial ASHA stops is killed while its Train run is going, so its
        # trial function may still see the controller die and write an "error" status on the way out.
        if res.error is not None:
            err_text = st.get("error") or str(res.error).strip().splitlines()[-1][:300]
            oom = st.get("status") == "oom" or "TrialOutOfMemory" in str(res.error) or "out of memory" in err_text.lower()
            status = "infeasible" if oom else "error"
            reason = f"out of memory when run (not retried): {err_text}" if oom else err_text
        elif m.get("finished") or st.get("status") == "finished":
            status, reason = "finished", ""
            m = {**(st.get("result") or {}), **m}
            samples = int(m.get(TIME_ATTR) or samples)
        elif samples:
            status, reason = "stopped", f"ASHA stopped it at {samples} samples"
        else:
            status, reason = "not run", "interrupted before it reported"
        recs = [x for x in read_metrics(tdir) if x.get("step", 0) * p["global_batch_size"] <= samples] if samples else []
        tps = [x["tokens_per_s"] for x in recs if x.get("tokens_per_s")]
        starts = (tdir / STARTS_FILE).read_text().splitlines() if (tdir / STARTS_FILE).exists() else []
        rows.append({
            "trial_id": trial_id, "status": status, "key": p["key"],
            "micro_batch_size": p["micro_batch_size"], "grad_accum_steps": p["grad_accum_steps"],
            "global_batch_size": p["global_batch_size"], "gradient_checkpointing": p["gradient_checkpointing"],
            "checkpoint_every_n_layers": p.get("checkpoint_every_n_layers"),
            "lr_scaling": p["lr_scaling"], "reference_batch_size": p["reference_batch_size"],
            "base_lr": lr, "effective_lr": lr * Point(p["micro_batch_size"], p["grad_accum_steps"],
                                                      p["global_batch_size"], p["lr_scaling"],
                                                      p["reference_batch_size"]).lr_scale,
            "estimate_gib": p["estimate_gib"], "budget_gib": plan.budget_gib,
            "samples_seen": samples, "tokens_seen": m.get("tokens_seen") or (sum(x.get("tokens", 0) for x in recs) or None),
            "steps": samples // p["global_batch_size"] if samples else 0,
            "eval_loss": m.get(METRIC) if status in ("finished", "stopped") else None,
            "tokens_per_s": m.get("tokens_per_s") if status == "finished" and m.get("tokens_per_s")
            else (sum(tps) / len(tps) if tps else None),
            "trainings_started": sum(1 for line in starts if line.endswith(" train")),
            "reason": reason, "output_dir": str(tdir),
        })
    for p in plan.points:
        if p.status == "planned":
            continue
        rows.append({
            "trial_id": None, "status": p.status, "key": p.key, "micro_batch_size": p.micro_batch_size or None,
            "grad_accum_steps": p.grad_accum_steps, "global_batch_size": p.global_batch_size,
            "gradient_checkpointing": p.gradient_checkpointing,
            "checkpoint_every_n_layers": p.checkpoint_every_n_layers, "lr_scaling": p.lr_scaling,
            "reference_batch_size": p.reference_batch_size, "base_lr": None, "effective_lr": None,
            "estimate_gib": p.estimate_gib, "budget_gib": plan.budget_gib, "samples_seen": 0, "tokens_seen": None,
            "steps": 0, "eval_loss": None, "tokens_per_s": None, "trainings_started": 0,
            "reason": p.reason, "output_dir": None,
        })
    order = {"finished": 0, "stopped": 1, "infeasible": 2, "error": 3, "not run": 4, "skipped": 5}
    rows.sort(key=lambda x: (order.get(x["status"], 9), x["eval_loss"] if x["eval_loss"] is not None else math.inf,
                             x["micro_batch_size"] or 0, x["grad_accum_steps"]))
    return rows


def set_aside(out: Path) -> Optional[Path]:
    """`--fresh`: the previous search (Tune experiment, trials, results) is renamed, never deleted."""
    if not out.exists() or not any(out.iterdir()):
        return None
    dest = out.with_name(f"{out.name}.set-aside-{time.strftime('%Y%m%dT%H%M%S')}")
    out.rename(dest)
    return dest
