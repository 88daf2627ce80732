"""Running a search plan (`tune.plan`) on Ray: each planned point becomes Ray Tune trials, each
trial a Ray Train TorchTrainer run of the trial's job (Train v2 inside a Tune function trainable).

Only `planned` points are launched; a trial refuses to start if its point is over budget, so
an infeasible configuration cannot run even through a hand-edited experiment state.

Out of memory is an answer, not a retry. Each trial's Train run has
`FailureConfig(max_failures=0)` and Tune's failure config does not retry either: a trial that
still runs out of memory is recorded as infeasible (its `status.json` says so) and the search
goes on. On resume (`Tuner.restore`, errored trials neither resumed nor restarted) a trial whose
own record says finished or out of memory is reported from that record, never trained again.

A lost node is the cluster's fault, not the configuration's: the search spec's `run.max_failures`
(the trial's own Train run keeps 0, so out of memory is never retried) is how many times a trial
whose training worker's node died (`jobs.launch.on_ray.node_lost`: Ray marked that node dead) trains
again, resuming from its newest checkpoint. Past that, the trial is an error that names the node,
and the search goes on.

Workers report every eval; `forward_metrics` turns optimizer steps into samples seen (ASHA's
time attribute), passes on the search's metric (`search.metric`: the job's `eval_loss`, its
`eval_rewards/accuracies` for a preference objective, or GRPO's held-out mean reward `eval_reward`)
and holds the final step back for the
trial function, which reports it once the job's outputs exist. Trials at once: what the
cluster holds (`concurrency`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from jobs.errors import NodeLost, SpecError, oom_line, worker_failure_line
from jobs.launch.on_ray import make_trainer, node_lost, relay_actor, reported_placement
from jobs.run.outputs import write_json_atomic
from jobs.run.summary import RunSummary
from jobs.spec import JobSpec

from .plan import (
    PLAN_FILE,
    STARTS_FILE,
    STATUS_FILE,
    TIME_ATTR,
    TRIALS_DIR,
    TUNE_DIR,
    Plan,
    Point,
    gib_str,
    spec_fingerprint,
    trial_job_dict,
    trial_name,
)
from .spec import SearchSpec
from .storage import in_store

log = logging.getLogger("rayft")


# ---- failures: out of memory inside Ray's wrapping ---------------------------------------------


class TrialOutOfMemory(RuntimeError):
    """A launched trial ran out of memory: recorded as infeasible, never retried."""


# ---- one trial ---------------------------------------------------------------------------


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def forward_metrics(m: dict, global_batch: int, max_steps: int, metric: str = "eval_loss") -> dict | None:
    """What one worker report becomes for Tune, or None to hold it back.

    `samples_seen` = optimizer steps x global batch: the ASHA time attribute. The final step is
    held back: the trial function reports it once the job has written its outputs, so an ASHA
    decision at the last rung can never cut the job off before summary.json and the adapter exist.
    Reports without `metric` (there are none with the cadence the plan sets) are held back too.
    Beside another metric the eval loss travels too, for the report.
    """
    step = m.get("step")
    if not step or step >= max_steps or m.get(metric) is None:
        return None
    out = {
        TIME_ATTR: int(step) * global_batch,
        metric: float(m[metric]),
        "step": int(step),
        "loss": m.get("loss"),
        "tokens_per_s": m.get("tokens_per_s"),
    }
    if metric != "eval_loss":
        out["eval_loss"] = m.get("eval_loss")
    return out


def _make_forwarder(global_batch: int, max_steps: int, metric: str):
    """A Ray Train UserCallback (it runs in the Train controller) that forwards rank 0's reports to
    the Tune session of the trial, as Ray's own `TuneReportCallback` does, through `forward_metrics`."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class ForwardToTune(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            out = forward_metrics(metrics[0], global_batch, max_steps, metric)
            if out is None:
                return
            if checkpoint is not None:
                out["checkpoint_path"] = checkpoint.path
            self._training_actor_item_queue.put(out)

    return ForwardToTune()


def _log_start(out: Path, what: str) -> None:
    with open(out / STARTS_FILE, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {what}\n")


def run_trial(config: dict, setup: dict) -> None:
    """Tune function trainable: one trial = one Ray Train TorchTrainer run of the trial's job."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    p, lr = config["point"], float(config["lr"])
    out = Path(setup["trials_dir"]) / trial_id
    out.mkdir(parents=True, exist_ok=True)
    d = trial_job_dict(setup["job"], p, lr, str(out), trial_name(setup["name"], trial_id), setup["budget_gib"])
    spec = JobSpec.model_validate(d)
    write_json_atomic(
        out / "trial.json",
        {"trial_id": trial_id, "point": p, "lr": lr, "effective_lr": spec.effective_lr, "spec": spec.to_dict()},
    )

    status = read_json(out / STATUS_FILE)
    if status and status.get("status") == "oom":
        # Ran out of memory before an interruption the experiment state did not see: still infeasible.
        _log_start(out, "out of memory earlier: not rerun")
        raise TrialOutOfMemory(
            f"out of memory at micro_batch_size={p['micro_batch_size']} (recorded earlier, "
            f"not retried): {status.get('error')}"
        )
    if status and status.get("status") == "finished":
        # Finished before an interruption the experiment state did not see: report, don't retrain.
        _log_start(out, "already finished: not rerun")
        tune.report(status["result"])
        return
    if p["estimate_gib"] is None or p["estimate_gib"] > setup["budget_gib"]:  # the plan never lets this through
        raise RuntimeError(f"trial {p['key']} is over budget and must not run")
    _log_start(out, "train")

    t0 = time.time()
    metric = setup.get("metric", "eval_loss")
    try:
        _fit(spec, p, out, int((setup["job"].get("run") or {}).get("max_failures") or 0), metric)
    except NodeLost as e:
        write_json_atomic(
            out / STATUS_FILE,
            {
                "status": "error",
                "error": str(e),
                "node_id": e.node_id,
                "node_ip": e.node_ip,
                "wall_s": time.time() - t0,
            },
        )
        raise
    except Exception as e:
        oom = oom_line(e)
        if oom:
            write_json_atomic(out / STATUS_FILE, {"status": "oom", "error": oom, "wall_s": time.time() - t0})
            raise TrialOutOfMemory(
                f"out of memory at micro_batch_size={p['micro_batch_size']} "
                f"(estimate {gib_str(p['estimate_gib'])}): {oom}"
            ) from None
        # a crashed worker's rank and Ray's words for its exit, not the first 500 characters of Ray's report
        error = worker_failure_line(e) or f"{type(e).__name__}: {str(e)[:500]}"
        write_json_atomic(out / STATUS_FILE, {"status": "error", "error": error})
        raise
    summary = RunSummary.from_json(read_json(out / "summary.json") or {}, str(out / "summary.json"))
    result = {
        TIME_ATTR: p["max_steps"] * p["global_batch_size"],
        "eval_loss": summary.eval_loss,
        "step": summary.steps,
        "loss": summary.final_loss,
        "tokens_per_s": summary.mean_tokens_per_s,
        "tokens_seen": summary.tokens_seen,
        "peak_mem_gib": summary.peak_mem_gib,
        "finished": True,
    }
    if metric != "eval_loss":
        result[metric] = final_value(summary.as_json(), out, metric, p["max_steps"])
    write_json_atomic(out / STATUS_FILE, {"status": "finished", "result": result, "wall_s": time.time() - t0})
    tune.report(result)


def final_value(summary: dict, out: Path, metric: str, max_steps: int) -> float | None:
    """`metric` at the trial's last step: summary.json's, else the final step's metrics.jsonl record
    (a job resumed at its last checkpoint trains no step and its summary carries only the eval loss)."""
    value = summary.get(metric)
    if value is not None:
        return value
    from jobs.run.outputs import read_metrics

    last = [r.value(metric) for r in read_metrics(out) if r.step == max_steps and r.value(metric) is not None]
    return last[-1] if last else None


def _fit(spec: JobSpec, p: dict, out: Path, node_retries: int, metric: str = "eval_loss") -> None:
    """Train the trial's job: its own TorchTrainer (max_failures 0 and one checkpoint kept come from
    the trial's spec) with rank 0's reports forwarded to this trial's Tune session; trained again,
    from its newest checkpoint, up to `node_retries` times when a node of its workers is lost."""
    # With several workers, each says where it runs (at every start): a survivor's error then
    # names a lost node.
    relay = relay_actor() if spec.resources.num_workers > 1 else None
    for attempt in range(node_retries + 1):
        forward = _make_forwarder(p["global_batch_size"], p["max_steps"], metric)
        trainer = make_trainer(spec, resume=True, relay=relay, callbacks=[forward])
        try:
            trainer.fit()
            return
        except Exception as e:
            lost = node_lost(e, placement=reported_placement(relay))
            if lost is None:
                raise
            if attempt == node_retries:
                raise NodeLost(
                    f"{lost}; the trial stopped ("
                    + (
                        f"after run.max_failures={node_retries} retries"
                        if node_retries
                        else "run.max_failures=0: set it to resume such a trial from its checkpoint"
                    )
                    + ")",
                    lost.node_id,
                    lost.node_ip,
                ) from None
            log.warning(
                "trial %s: %s; training again from its newest checkpoint (%d/%d)",
                out.name,
                lost,
                attempt + 1,
                node_retries,
            )
            _log_start(out, f"lost node {lost.node_id}, retry {attempt + 1}/{node_retries}: train")


def trial_dirname(trial) -> str:
    return trial.trial_id


# ---- the driver --------------------------------------------------------------------------


def per_trial_cpus(spec: SearchSpec) -> int:
    """A trial holds one CPU for the trial function and its workers' CPUs."""
    r = spec.resources
    return 1 + math.ceil(r.num_workers * r.cpus_per_worker)


def init_ray(address: str | None, num_cpus: int | None, per_trial: int) -> None:
    """An embedded Ray big enough for two trials at once: on 2 cores two 1-worker trials need
    4 logical CPUs."""
    from jobs.launch.on_ray import init_ray as init

    init(address, num_cpus or max(os.cpu_count() or 1, 2 * per_trial), log_to_driver=False)


def concurrency(spec: SearchSpec, n_trials: int, notes: list[str]) -> int:
    """Trials at once: what the cluster holds (1 CPU for the trial function + the workers' CPUs/GPUs)."""
    import ray

    r = spec.resources
    per_cpu = per_trial_cpus(spec)
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
    best: dict | None
    interrupted: bool
    resumed: bool
    files: dict[str, str]
    notes: list[str]


def check_resume(spec: SearchSpec, raw_spec: SearchSpec, resume: bool | None, spec_path: str = "spec") -> bool:
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
        raise SpecError(
            f"{spec_path}: cannot resume the search in {out}: the search spec changed since it "
            f"started ({shown or 'unreadable search_plan.json'}); use --fresh to start over "
            "(the old search is moved aside)"
        )
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


def tracking_callbacks(spec: SearchSpec) -> list:
    """`run.trackers: [mlflow]` on a search: every trial is a run of one MLflow experiment named
    after the search, at `run.mlflow_tracking_uri` (default the SQLite store `mlflow.db` in the
    search's output dir), through Ray Tune's `MLflowLoggerCallback`: the trial's config (its split, lr rule,
    lr) as parameters, every report (eval loss, samples seen) as metrics. A tracking server that
    cannot be reached is one warning and the search runs without it."""
    if "mlflow" not in spec.run.trackers:
        return []
    from jobs.run.tracking import experiment_id, shown_uri, tracking_uri

    uri = tracking_uri(spec)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    try:
        from mlflow.tracking import MlflowClient
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        # Reachable? And the experiment made here, so that in rayft's default store its
        # artifacts go beside the database; the callback then finds it by name.
        experiment_id(MlflowClient(uri), spec)
    except Exception as e:  # noqa: BLE001 - a tracker never fails the search
        logging.getLogger("rayft").warning(
            "tracker mlflow (%s) failed: %s; the search goes on without it", shown_uri(uri), type(e).__name__
        )
        return []
    return [MLflowLoggerCallback(tracking_uri=uri, experiment_name=spec.name, save_artifact=False)]


def run_search(
    spec: SearchSpec,
    raw_spec: SearchSpec,
    plan: Plan,
    *,
    resume: bool | None = None,
    address: str | None = None,
    num_cpus: int | None = None,
    spec_path: str = "spec",
) -> Outcome:
    """Run (or resume) the search. `spec` is absolutized for workers; `raw_spec` is what the user wrote
    (best.yaml keeps its relative paths). `resume`: None = if possible, True = must, False = fresh."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # rayft prints its own lines; verbose=0 then means quiet
    # Save the experiment state (trial statuses: what Tuner.restore resumes from) every 2 s instead
    # of Tune's adaptive >= 10 s: the state is a few KB, and a killed search then loses at most 2 s.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    from ray import tune

    from . import report

    out = spec.output_path
    exp = (out / TUNE_DIR).resolve()
    notes = list(plan.notes)
    resumed = check_resume(spec, raw_spec, resume, spec_path)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        out / PLAN_FILE,
        {"fingerprint": spec_fingerprint(raw_spec), "spec": raw_spec.model_dump(mode="json"), "plan": plan.to_dict()},
    )

    init_ray(address, num_cpus, per_trial_cpus(spec))
    n_trials = len(plan.planned) * spec.search.num_samples
    max_conc = concurrency(spec, n_trials, notes)

    setup = {
        "job": spec.job_dict(),
        "trials_dir": str((out / TRIALS_DIR).resolve()),
        "budget_gib": plan.budget_gib,
        "name": spec.name,
        "metric": plan.metric,
    }
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": 1})
    if resumed:
        print(f"resuming the search in {exp} (finished trials are not rerun)", file=sys.stderr, flush=True)
        tuner = tune.Tuner.restore(
            str(exp), trainable=trainable, resume_unfinished=True, resume_errored=False, restart_errored=False
        )
    else:
        tuner = _new_tuner(spec, plan, trainable, max_conc)
    print(
        f"search {spec.name}: {n_trials} trial(s) of {len(plan.points)} point(s) "
        f"({sum(p.status == 'infeasible' for p in plan.points)} infeasible, "
        f"{sum(p.status == 'skipped' for p in plan.points)} skipped); {notes[-1]}",
        file=sys.stderr,
        flush=True,
    )
    grid = _fit_quietly(tuner)
    interrupted = grid.num_terminated + grid.num_errors < len(grid)
    rows = in_store(spec, collect_rows(plan, grid, out))  # a search into a store: the trials named there
    best = report.pick_best(rows, plan.samples_per_trial, plan.metric, plan.mode)
    files = report.write_all(out, raw_spec, plan, rows, best, notes, interrupted=interrupted)
    return Outcome(rows, best, interrupted, resumed, files, notes)


def _new_tuner(spec: SearchSpec, plan: Plan, trainable, max_conc: int):
    """A fresh Tune experiment: the planned points as a grid, the lr drawn log-uniformly beside
    each, ASHA (or FIFO) on samples seen, no retries."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from .callbacks import Announce

    s = spec.search
    lo, hi = (s.lr.low, s.lr.high) if s.lr else (spec.optim.lr, spec.optim.lr)
    lr_space = tune.loguniform(lo, hi) if hi > lo else lo
    scheduler = (
        ASHAScheduler(
            time_attr=TIME_ATTR,
            max_t=plan.samples_per_trial,
            grace_period=plan.grace_samples,
            reduction_factor=s.asha.reduction_factor,
        )
        if s.scheduler == "asha"
        else FIFOScheduler()
    )
    seed = s.seed if s.seed is not None else spec.run.seed
    return tune.Tuner(
        trainable,
        param_space={"point": tune.grid_search([p.trial_config() for p in plan.planned]), "lr": lr_space},
        tune_config=tune.TuneConfig(
            metric=plan.metric,
            mode=plan.mode,
            scheduler=scheduler,
            num_samples=s.num_samples,
            # The concurrency limit goes to the generator: Tune ignores max_concurrent_trials when
            # a search_alg is passed, and a seeded generator is what makes the lr draws reproducible.
            search_alg=BasicVariantGenerator(max_concurrent=max_conc, random_state=seed),
            trial_dirname_creator=trial_dirname,
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR,
            storage_path=str(spec.output_path.resolve()),
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),  # never retried
            callbacks=[Announce(plan.metric), *tracking_callbacks(spec)],
        ),
    )


def _fit_quietly(tuner):
    """`tuner.fit()` without Tune's own failure lines for the failures rayft reports itself."""
    tune_log = logging.getLogger("ray.tune.tune")
    level = tune_log.level
    tune_log.setLevel(logging.CRITICAL)  # "Trials did not complete": rayft reports failed trials itself
    controller_log = logging.getLogger("ray.tune.execution.tune_controller")
    controller_log.addFilter(_known_trial_failures)
    try:
        return tuner.fit()
    finally:
        tune_log.setLevel(level)
        controller_log.removeFilter(_known_trial_failures)


def _known_trial_failures(record: logging.LogRecord) -> bool:
    """Drop Tune's "Trial task failed" traceback when the failure is one rayft recognises and
    reports itself, in one line and in the table (a lost node, out of memory); others keep it."""
    exc = record.exc_info[1] if record.exc_info else None
    known = (NodeLost, TrialOutOfMemory)
    return not (isinstance(exc, known) or isinstance(getattr(exc, "cause", None), known))


def collect_rows(plan: Plan, grid, out: Path) -> list[dict]:
    """One row per launched trial (from Tune's result grid and the trial's own files) and one per
    point that was never launched, best first."""
    rows = [row for res in grid if (row := _trial_row(plan, res, out)) is not None]
    rows += [_unlaunched_row(plan, p) for p in plan.points if p.status != "planned"]
    order = {"finished": 0, "stopped": 1, "infeasible": 2, "error": 3, "not run": 4, "skipped": 5}
    sign = 1 if plan.mode == "min" else -1  # best first
    rows.sort(
        key=lambda x: (
            order.get(x["status"], 9),
            sign * x[plan.metric] if x[plan.metric] is not None else math.inf,
            x["micro_batch_size"] or 0,
            x["grad_accum_steps"],
        )
    )
    return rows


def _point_fields(p: dict) -> dict:
    """A row's columns that describe its point (a launched trial's or a never-launched one's)."""
    return {
        "key": p["key"],
        "micro_batch_size": p["micro_batch_size"] or None,
        "grad_accum_steps": p["grad_accum_steps"],
        "global_batch_size": p["global_batch_size"],
        "gradient_checkpointing": p["gradient_checkpointing"],
        "checkpoint_every_n_layers": p.get("checkpoint_every_n_layers"),
        "lr_scaling": p["lr_scaling"],
        "reference_batch_size": p["reference_batch_size"],
    }


def _unlaunched_row(plan: Plan, point: Point) -> dict:
    """The row of a point that was never launched: infeasible or skipped, with why."""
    p = asdict(point) | {"key": point.key}
    return (
        {"trial_id": None, "status": point.status}
        | _point_fields(p)
        | {
            "base_lr": None,
            "effective_lr": None,
            "estimate_gib": p["estimate_gib"],
            "budget_gib": plan.budget_gib,
            "samples_seen": 0,
            "tokens_seen": None,
            "steps": 0,
            "eval_loss": None,
            "tokens_per_s": None,
            "trainings_started": 0,
            "reason": point.reason,
            "output_dir": None,
        }
        | _searched(plan, p, None)
    )


def _trial_verdict(res, st: dict, m: dict, samples: int) -> tuple[str, str, dict, int]:
    """A launched trial's status and reason from Tune's result `res` and the trial's own status
    file `st`; for a finished trial also its final metrics and samples. Tune's verdict comes first:
    a trial ASHA stops is killed while its Train run is going, so its trial function may still see
    the controller die and write an "error" status on the way out."""
    if res.error is not None:
        err_text = st.get("error") or str(res.error).strip().splitlines()[-1][:300]
        # A lost node is an error of the cluster whatever its death reason says (never infeasible).
        oom = not st.get("node_id") and (
            st.get("status") == "oom" or oom_line(res.error) is not None or oom_line(err_text) is not None
        )
        if oom:
            return "infeasible", f"out of memory when run (not retried): {err_text}", m, samples
        return "error", err_text, m, samples
    if m.get("finished") or st.get("status") == "finished":
        m = {**(st.get("result") or {}), **m}
        return "finished", "", m, int(m.get(TIME_ATTR) or samples)
    if samples:
        return "stopped", f"ASHA stopped it at {samples} samples", m, samples
    return "not run", "interrupted before it reported", m, samples


def _trial_row(plan: Plan, res, out: Path) -> dict | None:
    """The row of one launched trial; None for a Tune result that is not one of this plan's."""
    from jobs.run.outputs import read_metrics

    trial_id = Path(res.path).name
    tdir = out / TRIALS_DIR / trial_id
    # A trial restored from the experiment state without results has no config on its Result:
    # the trial's own record (or Tune's params.json) has it.
    cfg = res.config or read_json(tdir / "trial.json") or read_json(Path(res.path) / "params.json")
    if not cfg or "point" not in cfg:
        return None
    p = cfg["point"]
    lr = float(cfg["lr"])
    m = dict(res.metrics or {})
    status, reason, m, samples = _trial_verdict(res, read_json(tdir / STATUS_FILE) or {}, m, int(m.get(TIME_ATTR) or 0))
    gbs = p["global_batch_size"]
    recs = [x for x in read_metrics(tdir) if x.step * gbs <= samples] if samples else []
    tps = [x.tokens_per_s for x in recs if x.tokens_per_s]
    starts = (tdir / STARTS_FILE).read_text().splitlines() if (tdir / STARTS_FILE).exists() else []
    reported = status in ("finished", "stopped")
    return (
        {"trial_id": trial_id, "status": status}
        | _point_fields(p)
        | {
            "base_lr": lr,
            "effective_lr": plan.trial_spec(p, lr).effective_lr,  # the lr the trial trains with
            "estimate_gib": p["estimate_gib"],
            "budget_gib": plan.budget_gib,
            "samples_seen": samples,
            "tokens_seen": m.get("tokens_seen") or (sum(x.tokens for x in recs) or None),
            "steps": samples // gbs if samples else 0,
            "eval_loss": m.get("eval_loss") if reported else None,
            "tokens_per_s": m.get("tokens_per_s")
            if status == "finished" and m.get("tokens_per_s")
            else (sum(tps) / len(tps) if tps else None),
            "trainings_started": sum(1 for line in starts if line.endswith(" train")),
            "reason": reason,
            "output_dir": str(tdir),
        }
        | _searched(plan, p, m.get(plan.metric) if reported else None)
    )


def _searched(plan: Plan, point: dict, value: float | None) -> dict:
    """A row's beta and num_generations (where the objective has them: the ones the trial trains with)
    and its value of the search's metric (beside eval_loss, which every row has)."""
    extra = {"beta": plan.beta_of(point)} if plan.has_beta else {}
    extra |= {"num_generations": plan.generations_of(point)} if plan.has_generations else {}
    return extra | ({} if plan.metric == "eval_loss" else {plan.metric: value})
