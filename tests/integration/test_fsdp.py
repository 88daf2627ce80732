"""FSDP2 oracles on 2 CPU ranks over gloo: the same exactness as DDP.

* The accumulated, reduce-scattered gradient equals the big-batch gradient (fp32, ragged
  sequences, checkpointing on and off, resharding after forward or not, packed micro-batches
  against the unpacked big batch), and so does the
  gradient norm taken over the shards; clipping scales every shard by the same factor.
* Exactly one gradient reduction per FSDP unit with LoRA weights per optimizer step, counted at
  the collective (`jobs.train.fsdp.units`: the decoder layers; the embeddings and the head are frozen);
  the same counter sees one per micro-step when the gate is left open, so the count is not vacuous.
* fp16: the GradScaler works over sharded gradients; an overflow on one rank's shard makes
  every rank skip the step.
* A 2-worker FSDP run ends with the adapter of a 1-worker run; a run resumed from a checkpoint
  (FSDP or DDP, any worker count) ends with the uninterrupted run's adapter; the final adapter
  is a PEFT directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gradtools import ROOT, build_engine, final_adapter, reference_grads, rel_err, spawn, tiny_spec, window_inputs

from jobs.run import checkpoint as ckpt
from jobs.train import fsdp
from jobs.train.step import Engine, optimizer_step, train_window

CPU = torch.device("cpu")


def _sharded(spec, world: int, *, gc: bool = False, reshard: bool = True, precision: str = "fp32"):
    """build_engine's model (LoRA B perturbed, so every LoRA weight has a gradient), sharded
    with `jobs.train.fsdp.shard` as the loop does, with SGD(lr=1) over the shards."""
    engine, model, tok = build_engine(spec, gc=gc, precision=precision, optimizer=False)
    module = fsdp.shard(engine.module, model, precision, reshard, CPU, world)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = Engine(module, params, torch.optim.SGD(params, lr=1.0), engine.scaler, CPU, precision, world)
    return engine, model, tok


def _full(model, what: str = "grad") -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient (or value), gathered from the shards."""
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            t = p.grad if what == "grad" else p.detach()
            out[n] = t.full_tensor().clone()
    return out


# ---- (a) accumulation == big batch, and the norm over shards ------------------------------

CONFIGS = [(False, True), (True, True), (True, False)]  # (checkpointing, reshard_after_forward)


def _fsdp_grads(rank: int, world: int, micro: int):
    spec = tiny_spec(f"resources.num_workers={world}", f"batch.micro_batch_size={micro}")
    out = []
    for gc, reshard in CONFIGS:
        engine, model, tok = _sharded(spec, world, gc=gc, reshard=reshard)
        assert all(type(p).__name__ == "DTensor" for p in engine.params)
        mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world)
        train_window(engine, mbs, n_labels)
        got = _full(model)
        local = {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.requires_grad}
        norm = float(fsdp.clip_grad_norm(engine.params, float("inf")))
        clipped_to = norm / 4
        clipped_norm = float(fsdp.clip_grad_norm(engine.params, clipped_to))
        out.append((got, local, norm, clipped_norm, _full(model)))
    return out, spec.grad_accum_steps


@pytest.mark.slow
@pytest.mark.parametrize("micro", [2, 1], ids=["W2xN2xm2", "W2xN4xm1"])
def test_sharded_accumulated_gradient_equals_big_batch(micro, tmp_path):
    per_rank = spawn(_fsdp_grads, 2, tmp_path, micro)
    results, n = per_rank[0]
    assert n == 8 // (2 * micro)
    spec = tiny_spec("resources.num_workers=2", f"batch.micro_batch_size={micro}")
    ref = reference_grads(spec)
    ref_norm = sum(float(g.double().pow(2).sum()) for g in ref.values()) ** 0.5
    for (gc, reshard), (got, local, norm, clipped_norm, clipped), (_, other_local, *_) in zip(
        CONFIGS, results, per_rank[1][0], strict=True
    ):
        where = f"checkpointing={gc} reshard_after_forward={reshard}"
        assert len(got) == len(ref) > 0
        assert rel_err(got, ref) <= 1e-5, where
        # really sharded: each rank holds a different piece of the gradient
        assert any(not torch.equal(local[k], other_local[k]) for k in local), where
        assert sum(v.numel() for v in local.values()) < sum(v.numel() for v in ref.values())
        # the norm over the shards is the norm of the whole gradient, and clipping scales all shards
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, where
        assert abs(clipped_norm - norm) <= 1e-6 * norm  # returned: the norm before clipping
        assert rel_err(clipped, {k: v / 4 for k, v in ref.items()}) <= 1e-5, where


def _fsdp_packed_grads(rank: int, world: int):
    spec = tiny_spec(f"resources.num_workers={world}", "batch.micro_batch_size=4", "data.packing=true")
    engine, model, tok = _sharded(spec, world)
    mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world)
    train_window(engine, mbs, n_labels)
    return _full(model), sum("seq_ids" in mb for mb in mbs)


@pytest.mark.slow
def test_packed_sharded_accumulation_equals_the_unpacked_big_batch(tmp_path):
    """data.packing under FSDP (2 ranks x 1 accumulation step x micro-batch 4): packed micro-batches,
    reduce-scattered, against the unpacked big batch in one process."""
    per_rank = spawn(_fsdp_packed_grads, 2, tmp_path)
    assert sum(packed for _, packed in per_rank) > 0, "no micro-batch was packed: packing would go untested"
    ref = reference_grads(tiny_spec("resources.num_workers=2", "batch.micro_batch_size=4"))
    assert rel_err(per_rank[0][0], ref) <= 1e-5
    assert rel_err(per_rank[1][0], per_rank[0][0]) == 0.0  # the gathered gradient is the same on both ranks


VARIANTS = [(("lora.use_dora=true",), "fp32", 1e-5), ((), "bf16", 1e-2)]


def _variant_grads(rank: int, world: int):
    out = []
    for overrides, precision, _ in VARIANTS:
        spec = tiny_spec(f"resources.num_workers={world}", "batch.micro_batch_size=2", *overrides)
        engine, model, tok = _sharded(spec, world, gc=True, precision=precision)
        mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world)
        train_window(engine, mbs, n_labels)
        out.append(_full(model))
    return out


@pytest.mark.slow
def test_dora_and_bf16_under_fsdp(tmp_path):
    """DoRA (its magnitude vectors are sharded too, its weight norm reads the gathered base):
    exact like LoRA. bf16 (weights gathered in bf16, gradients reduced in fp32) against the
    same global batch under bf16 autocast in one process: measured 2.6e-3 on this data (bf16
    keeps 8 bits of mantissa); a missed or doubled reduction would be off by tens of percent."""
    per_rank = spawn(_variant_grads, 2, tmp_path)
    for (overrides, precision, bound), got in zip(VARIANTS, per_rank[0], strict=True):
        spec = tiny_spec("resources.num_workers=2", "batch.micro_batch_size=2", *overrides)
        ref = reference_grads(spec, precision=precision)
        if overrides:
            assert any("magnitude" in k for k in got)
        assert rel_err(got, ref) <= bound, (overrides, precision)


# ---- (b) one reduction per optimizer step, counted -------------------------------------------


def _count_reductions(rank: int, world: int, gate: str):
    spec = tiny_spec(f"resources.num_workers={world}", "batch.micro_batch_size=1")
    engine, model, tok = _sharded(spec, world)
    calls = {"n": 0}
    counted = [name for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce") if hasattr(dist, name)]
    originals = {name: getattr(dist, name) for name in counted}

    def counting(name):
        def call(*args, **kwargs):
            calls["n"] += 1
            return originals[name](*args, **kwargs)

        return call

    if gate == "every-micro-step":  # the gate left open: FSDP reduces after every backward
        engine.sync_gate = lambda last: fsdp.gradient_sync(engine.module, True)
    per_step = []
    for name in counted:
        setattr(dist, name, counting(name))
    try:
        for step in range(2):
            mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world, step=step)
            before = calls["n"]
            train_window(engine, mbs, n_labels)
            per_step.append(calls["n"] - before)
            engine.optimizer.zero_grad(set_to_none=True)
    finally:
        for name in counted:
            setattr(dist, name, originals[name])
    # The FSDP units with LoRA weights reduce their gradients; the others (embeddings, [final
    # norm, LM head]: all frozen) have none to reduce.
    units = fsdp.units(model).all()
    trainable = [
        {id(p) for m in (u if isinstance(u, list) else [u]) for p in m.parameters() if p.requires_grad} for u in units
    ]
    assert set().union(*trainable) == {id(p) for p in engine.params}
    return per_step, spec.grad_accum_steps, sum(1 for t in trainable if t), len(units), counted


@pytest.mark.slow
def test_one_gradient_reduction_per_optimizer_step(tmp_path):
    gated, n, groups, units, counted = spawn(_count_reductions, 2, tmp_path / "gated", "last-micro-step")[0]
    every, *_ = spawn(_count_reductions, 2, tmp_path / "open", "every-micro-step")[0]
    assert counted, "no reduce-scatter or all-reduce function to count"
    assert n == 4 and groups >= 2 and units > groups  # the frozen units (embeddings, head) reduce nothing
    assert every == [n * groups, n * groups], "the counter must see one reduction per group per micro-step"
    assert gated == [groups, groups], "gradients must be reduced once per optimizer step, not per micro-step"


# ---- fp16: GradScaler over shards ---------------------------------------------------------------


def _fp16_steps(rank: int, world: int):
    spec = tiny_spec(f"resources.num_workers={world}", "batch.micro_batch_size=2")
    engine, model, tok = _sharded(spec, world, precision="fp16")
    before = _full(model, "value")
    mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world)
    train_window(engine, mbs, n_labels)
    _, scale0 = optimizer_step(engine, None)
    after = _full(model, "value")
    # Second window: an overflow in rank 1's shard only. Every rank must skip the update.
    train_window(engine, mbs, n_labels)
    if rank == 1:
        engine.params[3].grad.to_local().view(-1)[0] = float("inf")
    _, scale1 = optimizer_step(engine, None)
    skipped = all(torch.equal(v, after[k]) for k, v in _full(model, "value").items())
    return {k: before[k] - after[k] for k in before}, scale0, scale1, engine.scaler.get_scale(), skipped


@pytest.mark.slow
def test_fp16_grad_scaler_over_shards_and_overflow_on_one_rank_skips_everywhere(tmp_path):
    per_rank = spawn(_fp16_steps, 2, tmp_path)
    spec = tiny_spec("resources.num_workers=2", "batch.micro_batch_size=2")
    ref = reference_grads(spec, precision="fp16")
    delta, scale0, scale1, scale_now, _ = per_rank[0]
    assert scale0 == 2.0**16 and scale1 == 2.0**16
    # same bound and reason as the DDP test (fp16 rounding of activations; scaling is exact)
    assert rel_err(delta, ref) <= 2e-2
    for r, (_, _, _, scale_after, skipped) in enumerate(per_rank):
        assert skipped, f"rank {r} applied an update although rank 1's gradient overflowed"
        assert scale_after == 2.0**15, f"rank {r} did not back off the scale"


# ---- (c), (d): whole runs through the loop (no Ray), checkpoints across strategies ------------

DEMO = "examples/tiny-lora.yaml"
RUN = [
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
    "data.max_seq_len=96",
    "lora.r=4",
    "run.max_steps=4",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=3",
    "run.eval_every=2",
]


def _train(rank: int, world: int, strategy: str, out: str) -> dict:
    import os

    from jobs.spec import absolutize, load_spec
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    os.chdir(ROOT)
    spec = absolutize(
        load_spec(
            DEMO, RUN + [f"resources.num_workers={world}", f"resources.strategy={strategy}", f"run.output_dir={out}"]
        )
    )
    return train(spec, LocalContext(on_progress=lambda r: None), resume=True)


def _run(tmp: Path, world: int, strategy: str, out: Path) -> dict:
    if world == 1:
        return _train(0, 1, strategy, str(out))
    return spawn(_train, world, tmp, strategy, str(out))[0]


def _interrupted_copy(src: Path, dst: Path) -> Path:
    """`src` as it was after its step-2 checkpoint: later checkpoints and outputs removed."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / ckpt.step_dir_name(4))
    for name in ("adapter", "summary.json", "base"):
        shutil.rmtree(dst / name, ignore_errors=True) if (dst / name).is_dir() else (dst / name).unlink(missing_ok=True)
    return dst


@pytest.fixture(scope="module")
def one_worker_run(tmp_path_factory) -> Path:
    """The uninterrupted 1-worker reference (no wrapping): its output directory."""
    tmp = tmp_path_factory.mktemp("fsdp-one")
    _run(tmp / "s1", 1, "ddp", tmp / "one")
    return tmp / "one"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_worker_run):
    """The uninterrupted references: 1 worker (no wrapping) and 2 FSDP workers. The Ray test needs
    only the first; under `make test`'s two processes it runs in the process of the "clusters" group."""
    tmp = tmp_path_factory.mktemp("fsdp-runs")
    two = tmp / "fsdp2"
    summary = _run(tmp / "s2", 2, "fsdp", two)
    return tmp, one_worker_run, two, summary


@pytest.mark.slow
def test_two_fsdp_workers_end_with_the_one_worker_adapter_in_peft_format(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp, one, two, summary = runs
    assert summary["strategy"] == "fsdp" and summary["num_workers"] == 2
    want = final_adapter(one)
    got = final_adapter(two)
    assert rel_err(got, want) <= 1e-5
    assert rel_err(want, ckpt.load_adapter(one / "checkpoints" / ckpt.step_dir_name(2))) > 1e-3  # it trained
    base = AutoModelForCausalLM.from_pretrained(two / "base")
    peft = PeftModel.from_pretrained(base, two / "adapter")
    loaded = {n: p.detach() for n, p in peft.named_parameters() if "lora_" in n}
    assert loaded.keys() == got.keys()
    assert rel_err(loaded, got) == 0.0
    # the checkpoint holds the full state, gathered from the shards
    assert all(got[k].shape == want[k].shape for k in want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,world,strategy",
    [("fsdp2", 2, "fsdp"), ("fsdp2", 4, "fsdp"), ("fsdp2", 1, "ddp"), ("one", 2, "fsdp")],
    ids=["fsdp2-to-fsdp2", "fsdp2-to-fsdp4", "fsdp2-to-1-worker", "1-worker-to-fsdp2"],
)
def test_resume_across_strategies_and_worker_counts_is_exact(runs, source, world, strategy, tmp_path):
    tmp, one, two, _ = runs
    src = {"one": one, "fsdp2": two}[source]
    out = _interrupted_copy(src, tmp.parent / f"{tmp.name}-{source}-to-{strategy}{world}")
    summary = _run(tmp_path, world, strategy, out)
    assert summary["resumed_from_step"] == 2 and summary["strategy"] == strategy
    assert rel_err(final_adapter(out), final_adapter(src)) <= 1e-5
    assert rel_err(final_adapter(out), final_adapter(one)) <= 1e-5


@pytest.mark.ray
@pytest.mark.slow
def test_rayft_run_with_two_fsdp_workers_on_ray(one_worker_run, tmp_path, ray_head):
    """The real entry point: `rayft run` on a Ray cluster (the session's head), 2 FSDP workers
    (gloo), ends with the 1-worker run's adapter and a PEFT adapter directory."""
    import json
    import subprocess
    import sys

    one = one_worker_run
    out = tmp_path / "ray"
    rayft = Path(sys.executable).parent / "rayft"
    p = subprocess.run(
        [
            str(rayft),
            "run",
            DEMO,
            *RUN,
            "resources.num_workers=2",
            "resources.strategy=fsdp",
            f"run.output_dir={out}",
            "--address",
            ray_head.address,
        ],
        cwd=ROOT,
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["num_workers"] == 2
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert rel_err(final_adapter(out), final_adapter(one)) <= 1e-5


def test_a_checkpoint_with_the_optimizer_state_by_position_still_resumes(tmp_path):
    """Checkpoints written before states were taken by name hold `optimizer.state_dict()` (keyed
    by position): `restore` maps the positions onto the trainable parameters' names."""
    spec = tiny_spec("batch.micro_batch_size=4")
    engine, model, tok = build_engine(spec)
    mbs, n_labels, _, _ = window_inputs(spec, tok, 0, 1)
    train_window(engine, mbs, n_labels)
    optimizer_step(engine, None)
    old = engine.optimizer.state_dict()
    assert all(isinstance(k, int) for k in old["state"]) and old["state"]
    state = {"step": 1, "tokens_seen": 0, "skipped_steps": 0, "world_size": 1, "resume_key": ckpt.resume_key(spec)}
    d = tmp_path / ckpt.step_dir_name(1)
    ckpt.write_rank_files(
        d,
        0,
        {
            ckpt.ADAPTER_FILE: {n: p for n, p in model.named_parameters() if p.requires_grad},
            ckpt.OPTIMIZER_FILE: old,
            ckpt.STATE_FILE: state,
            ckpt.rng_file(0): ckpt.rng_state(),
        },
    )
    fresh, fresh_model, _ = build_engine(spec)
    ckpt.restore(d, spec, 0, 1, fresh_model, fresh.optimizer, fresh.scaler)
    new = fresh.optimizer.state_dict()
    assert new["state"].keys() == old["state"].keys()
    for i, s in old["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(new["state"][i][key], s[key]), (i, key)
    assert (
        rel_err(
            {n: p.detach() for n, p in fresh_model.named_parameters() if p.requires_grad},
            {n: p.detach() for n, p in model.named_parameters() if p.requires_grad},
        )
        == 0.0
    )
