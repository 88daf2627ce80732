"""The training loop: DDP or FSDP2 LoRA fine-tuning with exact gradient accumulation.

Reads top to bottom in `train()`. The two pieces tests poke at directly are
`train_window()` (one optimizer step's forward/backward over all its micro-batches) and
`optimizer_step()` (unscale, clip, step, update). The invariants:

* The samples of optimizer step k do not depend on workers x accumulation x micro-batch
  (`jobs.data.GlobalBatches`; for a weighted mixture, `jobs.data.MixtureBatches`).
* The gradient is the mean over *all label tokens of the whole global batch*. Every rank
  knows the whole global batch (the sampler is deterministic and each rank holds the
  tokenized data), so the window's label-token count T is computed locally, without any
  communication, before the first micro-step. Each micro-batch's *summed* token loss is
  multiplied by W / T; DDP averages over W ranks, so the reduced gradient is exactly
  sum(all token losses) / T -- the big-batch gradient, not a mean of per-micro-batch means.
* Every micro-step but the last runs forward *and* backward inside `Engine.sync_gate` (DDP's
  `no_sync()`; FSDP2's `set_requires_gradient_sync(False)`, `jobs.train.fsdp`), so gradients are
  reduced once per optimizer step (an all-reduce under DDP, a reduce-scatter under FSDP).
* fp16: the GradScaler scales every micro-step's loss, `unscale_` runs once before
  clipping, `step`/`update` once per window; a skipped step is counted.
* Every objective runs through one interface (`jobs.objectives.Objective`): it collates the
  window's samples, says what the step's loss is a mean over (label tokens T above; the P pairs of
  the global batch for a preference objective, whose module output is its *summed* per-pair loss,
  scaled by W / P), reads the step's statistics and runs the held-out evaluation. This module
  names no objective.

No `.item()` inside the window: scalars are read once per optimizer step (and transformers'
own per-forward sync is turned off where the model loads: `jobs.model.loading.skip_packed_sequence_detection`).

The host work of a step (`micro_batches_of`: the global batch's indices, length grouping, the
window's counts, a mixture's per-source counts, this rank's split and collation) is numpy over
the cache's arrays (a mixture's sources side by side have the same ones), and it runs
one step ahead on a background thread (`jobs.train.prefetch.Prefetch`) while the current step
computes. It is a pure function of the step, so the thread changes when it runs, never what
the step trains on; an exception in it is raised in the training thread at the step it belongs to.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs.data import Dataset, Sampler
from jobs.data.prompts import PromptData
from jobs.errors import RunError
from jobs.memory import MemoryPlan
from jobs.model.loading import (
    add_lora,
    check_batchnorm,
    check_packing,
    compile_layers,
    compile_wanted,
    enable_checkpointing,
    load_base_model,
    no_save_progress_bar,
)
from jobs.objectives import Objective
from jobs.objectives.base import Window as Window  # re-exported: tests read it from here
from jobs.objectives.base import all_reduce_sum

# Re-exported: tests and bench/ import these from here.
from jobs.objectives.sft import CausalLMLoss as CausalLMLoss
from jobs.objectives.sft import layout_args as layout_args
from jobs.run import checkpoint as ckpt
from jobs.run import mirror, runlock, save_check
from jobs.run.outputs import (
    PLOT,
    SUMMARY,
    MetricsLog,
    append_event,
    plot_loss,
    read_metrics,
    write_json_atomic,
)
from jobs.run.ownership import hold_on_rank0
from jobs.run.step_record import StepRecord
from jobs.run.storage import is_uri
from jobs.run.summary import RunSummary
from jobs.run.tracking import Trackers, open_trackers
from jobs.spec import JobSpec, compute_precision
from jobs.train import fsdp
from jobs.train.context import Context
from jobs.train.early_stopping import EarlyStopping
from jobs.train.faults import from_env
from jobs.train.prefetch import Prefetch
from jobs.train.step import (
    Engine,
    lr_at,
    make_optimizer,
    optimizer_step,
    peak_memory_bytes,
    train_window,
)

log = logging.getLogger("rayft")
GIB = 1024**3


def memory_plan(spec: JobSpec, device: torch.device) -> MemoryPlan:
    """The plan this worker runs: `jobs.memory.plan_for_spec` judged against `memory.budget_gib`,
    else the memory of this worker's GPU (the one input only the worker can see)."""
    from jobs.memory import plan_for_spec

    gpu_gib = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
    return plan_for_spec(spec, device="cuda" if device.type == "cuda" else "cpu", gpu_memory_gib=gpu_gib)


@dataclass
class Job:
    """What `train` sets up before the first step: the model with its adapters, the plan it runs
    and the data. (The optimizer is the Engine's: under FSDP it steps on the shards, which exist
    only once the model is wrapped.)"""

    model: Any  # the PEFT model (not wrapped; under FSDP its layers are sharded in place); untyped
    tokenizer: Any  # a transformers tokenizer
    plan: MemoryPlan
    precision: str
    data: Dataset | PromptData  # the token cache's (SFT, pairs), or online RL's prompts
    batches: Sampler  # `GlobalBatches`, or `MixtureBatches` for a mixture (`data.mix`)
    steps: int  # optimizer steps of the whole run
    scaler: torch.amp.GradScaler
    resume_key: dict  # what a checkpoint of this run must match to be resumed (taken once, at the start)
    strategy: str = "ddp"  # "ddp" (also one process) or "fsdp": see `strategy_of`
    objective: Objective = field(default_factory=Objective)  # `Objective()`: the default one
    reference: dict | None = None  # split -> [pairs, 2] precomputed reference log-probs (`objective.reference`)
    device: torch.device | None = None
    compiled: bool = False  # the decoder layers run through torch.compile (`compile_wanted`)


@dataclass
class Position:
    """Where the run stands; a checkpoint restores it."""

    step: int = 0  # optimizer steps done (= the next global batch)
    tokens_seen: int = 0
    skipped_steps: int = 0
    eval_loss: float | None = None
    source: str | None = None  # the checkpoint resumed from
    early_stopping: dict | None = None  # `EarlyStopping.state()` of the checkpoint
    eval_stats: dict = field(default_factory=dict)  # preference objectives: the last evaluation's statistics


def strategy_of(plan: MemoryPlan, world_size: int) -> str:
    """ "fsdp" or "ddp" (one process runs unwrapped, whatever is asked). The plan already holds an
    explicit `resources.strategy` and decides `auto` (`jobs.memory.plan_for_spec`)."""
    return plan.strategy if world_size >= 2 else "ddp"


def set_up(spec: JobSpec, ctx: Context) -> Job:
    """Model, adapters, the memory plan (strategy, checkpointing), data; nothing trained yet."""
    if ctx.world_size != spec.resources.num_workers:
        raise RunError(
            f"resources.num_workers={spec.resources.num_workers} but the runner started {ctx.world_size} workers"
        )
    precision = compute_precision(spec.precision, ctx.device.type)
    model, tokenizer = load_base_model(spec, precision)
    if spec.data.packing:
        check_packing(model.config)
    model = add_lora(model, spec, precision)
    model = check_batchnorm(model, spec.model.sync_batchnorm, ctx.world_size)
    plan = memory_plan(spec, ctx.device)
    if plan.checkpoint_every_n_layers:
        enable_checkpointing(model, every_n_layers=plan.checkpoint_every_n_layers)
    compiled = compile_wanted(spec.model, ctx.device.type)
    if compiled:
        compile_layers(model)
    strategy = strategy_of(plan, ctx.world_size)
    if strategy != "fsdp":  # FSDP moves each rank's shards to the device itself (`make_engine`)
        model.to(ctx.device)
    model.train()
    objective = Objective.of(spec)
    data, batches, steps = objective.load_data(spec, tokenizer)
    return Job(
        model,
        tokenizer,
        plan,
        precision,
        data,
        batches,
        steps,
        torch.amp.GradScaler(ctx.device.type, enabled=precision == "fp16"),
        ckpt.resume_key(spec),
        strategy,
        objective,
        device=ctx.device,
        compiled=compiled,
    )


def resume_or_seed(spec: JobSpec, ctx: Context, job: Job, engine: Engine, resume: bool) -> Position:
    """Continue from the newest complete checkpoint on disk (Ray Train writes its checkpoints
    there too, so a worker restarted by Ray and a rerun of the same command find the same one),
    or seed this rank for a fresh start."""
    newest = ctx.newest_checkpoint(spec) if resume else None
    if newest is None:
        # Per-rank seed for dropout; the data order does not depend on it.
        torch.manual_seed(spec.run.seed * 7919 + ctx.rank)
        random.seed(spec.run.seed * 7919 + ctx.rank)
        return Position()
    state = ckpt.restore(newest, spec, ctx.rank, ctx.world_size, job.model, engine.optimizer, job.scaler)
    job.objective.restored(newest)
    pos = Position(
        state["step"],
        state["tokens_seen"],
        state["skipped_steps"],
        state.get("eval_loss"),
        str(newest),
        state.get("early_stopping"),
        state.get("eval_stats") or {},
    )
    if ctx.is_main and pos.step >= job.steps:
        log.warning(
            "%s already ran all %d steps (%s): nothing to train; outputs are rewritten from it (--fresh trains again)",
            spec.name,
            job.steps,
            newest,
        )
    elif ctx.is_main:
        log.warning("resuming from %s at optimizer step %d", newest, pos.step)
    return pos


def make_engine(spec: JobSpec, ctx: Context, job: Job) -> Engine:
    """The loss module wrapped for the strategy, and the optimizer over the parameters that
    strategy trains (FSDP replaces each parameter by its shard, so the optimizer comes after)."""
    module = loss_module(job)
    if job.strategy == "fsdp":
        module = fsdp.shard(
            module, job.model, job.precision, reshard_after_forward(job.plan), ctx.device, ctx.world_size
        )
    elif ctx.world_size > 1:
        module = nn.parallel.DistributedDataParallel(
            module,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            find_unused_parameters=False,
        )
    params = [p for p in job.model.parameters() if p.requires_grad]
    return Engine(
        module, params, make_optimizer(spec, params, ctx.device), job.scaler, ctx.device, job.precision, ctx.world_size
    )


def loss_module(job: Job) -> nn.Module:
    """The module one micro-step calls: the objective's summed loss (`Objective.loss_module`)."""
    # FSDP keeps the head eager: its unit's all-gather hooks run around the head's call.
    compiled_head = job.compiled and job.strategy != "fsdp"
    return job.objective.loss_module(job.model, job.plan.loss_chunk_tokens, compiled_head)


def reshard_after_forward(plan: MemoryPlan) -> bool:
    """FSDP: free each layer's gathered weights after its forward? The plan's choice, which is
    `resources.fsdp_reshard_after_forward` when set (`jobs.memory.strategy_choices`)."""
    return plan.reshard_after_forward is not False


def micro_batches_of(spec: JobSpec, ctx: Context, job: Job, step: int) -> Window:
    """This rank's share of global batch `step` as the objective plans it from host data
    (`Objective.plan_window`): a pure function of `step`, so it may run ahead, on `Prefetch`'s thread."""
    return job.objective.plan_window(spec, ctx, job, step)


def train(spec: JobSpec, ctx: Context, *, resume: bool = True, run_token: str | None = None) -> dict:
    """Run the job described by `spec` on this rank. Returns the summary (rank 0; {} elsewhere).

    Rank 0 owns the output dir for the run (`jobs.run.ownership`) unless the driver whose token
    is `run_token` holds it already."""
    if not ctx.is_main:
        return _train(spec, ctx, resume=resume)
    # before the model loads: a directory rayft may not write, or another run's, is refused first
    locked = hold_on_rank0(spec.output_path, name=spec.name, run_token=run_token)
    try:
        return _train(spec, ctx, resume=resume)
    finally:
        if locked:
            runlock.release(spec.output_path)


def _train(spec: JobSpec, ctx: Context, *, resume: bool) -> dict:
    job = set_up(spec, ctx)
    try:
        return _train_job(spec, ctx, job, resume=resume)
    finally:
        job.objective.release()  # e.g. the vLLM server rayft started, also when a step raised


def _train_job(spec: JobSpec, ctx: Context, job: Job, *, resume: bool) -> dict:
    engine = make_engine(spec, ctx, job)
    job.objective.prepare(spec, ctx, job, engine)
    pos = resume_or_seed(spec, ctx, job, engine, resume)
    log = StepLog.open(spec, ctx, pos.step)
    if ctx.is_main:
        announce(spec, ctx, job, pos)

    faults, clock = from_env(), RunClock()
    last: StepRecord | None = None  # none when a rerun of a finished job trains no step
    stopper = EarlyStopping.of(spec, pos.early_stopping)
    steps = range(pos.step, pos.step if stopper.stopped else job.steps)
    with Prefetch(lambda k: micro_batches_of(spec, ctx, job, k), steps) as ahead:  # builds step k+1 during k
        for step in steps:
            t0 = time.perf_counter()
            lr = set_lr(engine, lr_at(step, job.steps, spec))
            window = ahead.get(step)  # waits only if the background build is not done yet
            window = job.objective.with_rollouts(spec, ctx, job, engine, step, window)  # online RL samples here
            faults.at_step(step, ctx.rank, spec.batch.micro_batch_size)

            sums = train_window(engine, window.micro_batches, window.denominator)
            grad_norm, scale_before = optimizer_step(engine, spec.optim.max_grad_norm)

            # One small all-reduce for logging; then the only host reads of the step.
            loss, stats = job.objective.step_values(all_reduce_sum(sums, ctx.world_size), window.denominator)
            skipped = scale_before is not None and job.scaler.get_scale() < scale_before
            norm = float(grad_norm.item())
            stop_if_not_finite(spec, step + 1, loss, norm, skipped)
            pos.skipped_steps += int(skipped)
            pos.tokens_seen += window.n_inputs
            dt = clock.stepped(time.perf_counter() - t0, window.n_inputs)
            done = step + 1
            evaluated = evaluate_if_due(spec, ctx, job, engine, pos, stopper, done)
            last = step_record(
                job, pos, window, done, ctx.device, loss=loss, lr=lr, grad_norm=norm, dt=dt, skipped=skipped
            )
            last = replace(last, evaluated=evaluated, extra={**window.metrics, **stats, **pos.eval_stats})
            log.step(last, first=step == pos.step, total_steps=job.steps)

            every = spec.run.checkpoint_every
            if (every and done % every == 0) or done == job.steps or stopper.stopped:
                save_checkpoint(spec, ctx, job, engine, pos, done, last, stopper)
                log.trackers.checkpointed(done)
                stopper.checkpointed(spec.output_path if ctx.is_main else None)
            if stopper.stopped:
                break
    return finish(spec, ctx, job, engine, pos, last, stopper, log, clock)


def set_lr(engine: Engine, lr: float) -> float:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    return lr


@dataclass
class RunClock:
    """This run's training time and tokens (not the resumed part): the summary's mean throughput."""

    tokens: int = 0
    step_s: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def stepped(self, dt: float, n_inputs: int) -> float:
        self.tokens, self.step_s = self.tokens + n_inputs, self.step_s + dt
        return dt

    def mean_tokens_per_s(self) -> float | None:
        return self.tokens / self.step_s if self.step_s else None


@dataclass
class StepLog:
    """Where each step's record goes: metrics.jsonl, the trackers and the progress line (the
    main rank writes; every rank holds the trackers object, which does nothing off the main rank)."""

    ctx: Context
    out: Path
    metrics: MetricsLog | None
    trackers: Trackers

    @classmethod
    def open(cls, spec: JobSpec, ctx: Context, step: int) -> StepLog:
        metrics = MetricsLog(spec.output_path, step) if ctx.is_main else None
        return cls(ctx, spec.output_path, metrics, open_trackers(spec, step, ctx.is_main))

    def step(self, record: StepRecord, *, first: bool, total_steps: int) -> None:
        if self.metrics is None:  # made on the main rank only
            return
        if first:  # the first step of this run
            append_event(self.out, "first_step", step=record.step)
        self.metrics.write(record)
        self.trackers.log_step(record.line())
        self.ctx.progress(record.with_total(total_steps))


def evaluate_if_due(
    spec: JobSpec, ctx: Context, job: Job, engine: Engine, pos: Position, stopper: EarlyStopping, done: int
) -> bool:
    """The held-out evaluation every `run.eval_every` steps and at the last (a mixture: also per
    source, from the same sums); early stopping judges it. True when it ran."""
    due = bool(spec.run.eval_every and done % spec.run.eval_every == 0) or done == job.steps
    if due:
        pos.eval_loss, pos.eval_stats = job.objective.held_out(engine, job, spec, ctx)
        value = stopper.value_of(pos.eval_loss, pos.eval_stats)
        stopper.judge(done, value, lambda: fsdp.full_adapter(job.model), spec.output_path, ctx.is_main)
    return due


def step_record(
    job: Job,
    pos: Position,
    window: Window,
    done: int,
    device: torch.device,
    *,
    loss: float,
    lr: float,
    grad_norm: float,
    dt: float,
    skipped: bool,
) -> StepRecord:
    """The step's record (metrics.jsonl's line, the trackers' and progress line's values); the
    window's per-source counts and the objective's statistics are added by the caller."""
    peak, peak_kind = peak_memory_bytes(device)
    return StepRecord(
        step=done,
        loss=loss,
        lr=lr,
        grad_norm=grad_norm,
        tokens=window.n_inputs,
        tokens_seen=pos.tokens_seen,
        label_tokens=window.n_labels,
        tokens_per_s=window.n_inputs / dt,
        step_time_s=dt,
        epoch=job.batches.epoch_of(done),
        peak_mem_gib=peak / GIB,
        peak_mem_kind=peak_kind,
        estimate_gib=job.plan.total_gib,
        skipped=skipped,
        eval_loss=pos.eval_loss,
    )


def finish(
    spec: JobSpec,
    ctx: Context,
    job: Job,
    engine: Engine,
    pos: Position,
    last: StepRecord | None,
    stopper: EarlyStopping,
    log: StepLog,
    clock: RunClock,
) -> dict:
    """The run's outputs (adapter, summary, plot) on the main rank; every rank takes part in
    gathering the adapter (under FSDP the shards are gathered to rank 0)."""
    adapter = fsdp.full_adapter(job.model)
    trained = save_check.trained_state(job.model, engine.optimizer)  # every rank: by the optimizer's parameters
    summary: dict = {}
    if ctx.is_main:
        assert log.metrics is not None
        log.metrics.close()
        best = stopper.best_adapter(spec.output_path)  # the best step's values: the trained ones are the last's
        adapter = best or adapter
        save_check.check_state(adapter, trained, str(spec.output_path / "adapter"), values=best is None)
        summary = write_outputs(
            spec,
            job,
            pos,
            last,
            adapter,
            wall_s=time.perf_counter() - clock.start,
            mean_tokens_per_s=clock.mean_tokens_per_s(),
            extra=stopper.summary(),
        )
        log.trackers.finish(
            summary, [spec.output_path / SUMMARY, spec.output_path / PLOT, spec.output_path / "adapter"]
        )
        mirror.push_outputs(spec, ctx.run_token)  # an object-store run.output_dir: the outputs, summary.json last
    ctx.report({**(last.line() if last else {}), "done": True})
    return summary


def announce(spec: JobSpec, ctx: Context, job: Job, pos: Position) -> None:
    """Rank 0, before the first step: the run's start in events.jsonl, and the plan in one line."""
    append_event(
        spec.output_path,
        "resume" if pos.step else "start",
        step=pos.step,
        world_size=ctx.world_size,
        checkpoint=pos.source,
    )
    unit = job.objective.unit
    log.warning(
        "job %s: %d steps, global batch %d%s = %d%s workers x %d accumulation x %d micro; lr %.3g (base "
        "%.3g x %s scaling %.3g at reference batch %d); precision %s; gradient checkpointing %s; "
        "compiled layers %s; estimate %.2f GiB",
        spec.name,
        job.steps,
        spec.batch.global_batch_size,
        unit,
        ctx.world_size,
        f" {job.strategy.upper()}" if ctx.world_size > 1 else "",
        spec.grad_accum_steps,
        spec.batch.micro_batch_size,
        spec.effective_lr,
        spec.optim.lr,
        spec.optim.lr_scaling,
        spec.lr_scale,
        spec.reference_batch_size,
        job.precision,
        job.plan.checkpointing,
        "on" if job.compiled else "off",
        job.plan.total_gib,
    )


def save_checkpoint(
    spec: JobSpec,
    ctx: Context,
    job: Job,
    engine: Engine,
    pos: Position,
    done: int,
    last: StepRecord,
    stopper: EarlyStopping,
) -> None:
    """Every rank, after optimizer step `done`: its files of checkpoint `step-<done>` (rank 0 adds
    the adapter, optimizer and scaler), with the position that resuming continues from. The
    adapter and optimizer state are the full ones, by parameter name, whatever the strategy
    (gathered from the FSDP shards), so any strategy and worker count can resume from them."""
    state = {
        "step": done,
        "next_global_batch": done,
        "tokens_seen": pos.tokens_seen,
        "skipped_steps": pos.skipped_steps,
        "world_size": ctx.world_size,
        "eval_loss": pos.eval_loss,
        "resume_key": job.resume_key,
        "early_stopping": stopper.state(),
        "eval_stats": pos.eval_stats,
    }
    adapter, optim_state = fsdp.adapter_state(job.model, engine.optimizer)  # every rank: a collective under FSDP
    trained = save_check.trained_state(job.model, engine.optimizer)  # every rank: a collective under FSDP
    if ctx.is_main:  # written only if whole; its file is read back as it is written (`ckpt.write_rank_files`)
        save_check.check_state(adapter, trained, f"checkpoint {ckpt.step_dir_name(done)}")
    shared = (adapter, optim_state, job.scaler) if ctx.is_main else ()
    ctx.save_checkpoint(
        spec.output_path / "checkpoints",
        done,
        ckpt.rank_files(ctx.rank, state, *shared) | job.objective.checkpoint_files(ctx.rank),
        last.line(),
        spec.run.keep_checkpoints,
    )
    ctx.barrier()  # every rank's files are in place before an object store gets them
    ctx.publish_checkpoint(spec, done)


def stop_if_not_finite(spec: JobSpec, step: int, loss: float, grad_norm: float, skipped: bool) -> None:
    """Stop the run at optimizer step `step` (1-based) when its loss or gradient norm is NaN or
    infinite, unless the fp16 GradScaler skipped the step (then overflow is its normal signal and
    the update was not applied). Raised before this step is logged or checkpointed, so the newest
    checkpoint on disk is the last good one. Every rank sees the same values (the loss is
    all-reduced, the gradient norm is taken after DDP's reduction), so all ranks stop together."""
    if skipped or (math.isfinite(loss) and math.isfinite(grad_norm)):
        return
    last = _last_checkpoint(spec)
    kept = f"the last good checkpoint is kept: {last}" if last else "no checkpoint was written before it"
    raise RunError(
        f"optimizer step {step}: training diverged (loss {loss:g}, grad norm {grad_norm:g}); "
        f"stopped, {kept}; lower optim.lr (now {spec.optim.lr:g}) or set optim.max_grad_norm"
    )


def _last_checkpoint(spec: JobSpec) -> str | None:
    """The run's newest checkpoint, as a user finds it: the local one that verifies, or for a run
    into a bucket the newest this rank wrote, named in the bucket (over several nodes, rank 0's
    staging directory holds only its own part of each; every part was uploaded as it was written)."""
    root = spec.output_path / "checkpoints"
    if not is_uri(spec.output_location):
        last = ckpt.newest_complete(root, warn=False)
        return str(last) if last else None
    written = ckpt.list_checkpoints(root)
    return f"{spec.output_location.rstrip('/')}/checkpoints/{written[-1].name}" if written else None


def write_outputs(
    spec: JobSpec,
    job: Job,
    pos: Position,
    last: StepRecord | None,
    adapter: dict,
    *,
    wall_s: float,
    mean_tokens_per_s: float | None,
    extra: dict | None = None,
) -> dict:
    """Rank 0, at the end: `adapter` (the full trainable state, `fsdp.full_adapter`) in PEFT
    format, the loss curve, summary.json. PEFT writes the given state rather than reading the
    model's parameters, which under FSDP are this rank's shards only."""
    out = spec.output_path
    records = read_metrics(out)
    adapter_dir = out / "adapter"
    # The trained adapter only: a frozen reference adapter (`model.adapter` under DPO/IPO) is the
    # starting one, already on disk.
    job.model.save_pretrained(adapter_dir, state_dict=adapter, selected_adapters=["default"])
    save_check.check_adapter_dir(adapter_dir, job.model, adapter)
    job.tokenizer.save_pretrained(adapter_dir)
    if spec.model.name == "tiny-llama":
        _save_tiny_base(spec, out / "base", adapter_dir)
    plot_loss(out, records, **job.objective.plot_labels(spec))
    final = last or (records[-1] if records else None)  # a rerun of a finished job trains no step
    summary = RunSummary(
        name=spec.name,
        steps=job.steps,
        resumed_from_step=pos.step,
        first_loss=records[0].loss if records else None,
        final_loss=final.loss if final else None,
        eval_loss=pos.eval_loss,
        tokens_seen=pos.tokens_seen,
        skipped_steps=pos.skipped_steps,
        wall_time_s=wall_s,
        mean_tokens_per_s=mean_tokens_per_s,
        peak_mem_gib=final.peak_mem_gib if final else None,
        peak_mem_kind=final.peak_mem_kind if final else None,
        estimate_gib=job.plan.total_gib,
        precision=job.precision,
        gradient_checkpointing=bool(job.plan.checkpoint_every_n_layers),
        checkpoint_every_n_layers=job.plan.checkpoint_every_n_layers,
        compiled_layers=job.compiled,
        effective_lr=spec.effective_lr,
        global_batch_size=spec.batch.global_batch_size,
        micro_batch_size=spec.batch.micro_batch_size,
        grad_accum_steps=spec.grad_accum_steps,
        num_workers=spec.resources.num_workers,
        strategy=job.strategy,
        adapter_dir=str(adapter_dir),
        dropped_records=job.data.dropped,
        objective=spec.objective.name,
        stats={**pos.eval_stats, **(extra or {})},
    ).as_json()
    write_json_atomic(out / SUMMARY, summary)
    append_event(out, "end", step=job.steps)
    return summary


def _save_tiny_base(spec: JobSpec, base_dir: Path, adapter_dir: Path) -> None:
    """tiny-llama has no hub id: save the base beside the adapter and point the adapter at it."""
    import json

    model, tok = load_base_model(spec, "fp32", quantized=False)  # the plain base, also for a QLoRA run
    with no_save_progress_bar():
        model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(base_dir.resolve())
    cfg_path.write_text(json.dumps(cfg, indent=2))
