"""Oracles for the preference objectives (DPO, IPO, SimPO, ORPO), the same as SFT's:

* **The big-batch gradient, independently.** The reference gradient is computed here without
  rayft's pair machinery: each pair's chosen and rejected sequence run alone (no padding, no
  label gathering) through the plain HF forward, log-probabilities from `log_softmax` of the full
  logits, the reference with PEFT's `disable_adapter()`, the per-pair loss by its formula (written
  again below), the mean over the 8 pairs of the global batch, one backward.
* **Split equivalence.** The same global batch as 1 x 1 x 8, 2 x 2 x 2 and 4 x 2 x 1 (workers x
  accumulation x micro-batch, gloo ranks) gives that gradient to 1e-5 (fp32), under DDP and under
  FSDP, with checkpointing, and within the bf16 / fp16 bounds of tests/unit/train/test_accumulation.py and
  tests/integration/test_qlora.py on an nf4 base and under the GradScaler.
* **One gradient reduction per optimizer step**, counted at DDP's comm hook, with the reference
  forward inside every micro-step's forward.
* **The reference**: precomputed values equal the in-step forward; the frozen starting adapter
  (`model.adapter`) is the reference for DPO (the first step's loss is log 2 on every pair).
* **Bitwise resume** of a DPO run (the adapter after 2 + 2 steps is the one after 4).

These fail on a mean of per-micro-batch means of pair losses, on dividing by tokens instead of
pairs, on chosen/rejected rows paired wrongly, on a reference that sees the adapter, and on
all-reduces inside the accumulation window.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gradtools import ROOT, grads, perturb_lora_b, rel_err, spawn
from torch import nn

from jobs.data import GlobalBatches, collate_pairs, load_dataset, split_window
from jobs.model.loading import add_lora, enable_checkpointing, load_base_model
from jobs.objectives import Objective
from jobs.objectives.preference import REFERENCE_ADAPTER, PreferenceLoss
from jobs.spec import JobSpec, load_spec
from jobs.train.step import Engine, train_window

PAIRS = ROOT / "examples" / "data" / "tiny-pairs.jsonl"
PAIRS_EVAL = ROOT / "examples" / "data" / "tiny-pairs-eval.jsonl"
# "rpo": DPO with objective.rpo_alpha (the chosen response's NLL added per pair)
OBJECTIVES = ["dpo", "ipo", "simpo", "orpo", "rpo"]
# (workers, micro_batch_size) for a global batch of 8 pairs
SPLITS = [(1, 8), (2, 2), (4, 1)]
SPLIT_IDS = [f"W{w}xN{8 // (w * m)}xm{m}" for w, m in SPLITS]


def pref_spec(*overrides: str) -> JobSpec:
    data = {
        "name": "p",
        "data": {"path": str(PAIRS), "max_seq_len": 96},
        "objective": {"name": "dpo"},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "run": {"max_steps": 2},
    }
    return load_spec(data=data, overrides=list(overrides))


def objective_overrides(name: str) -> tuple:
    # SimPO's beta as in its paper (2.0); IPO's default 0.1 (its target margin 1 / (2 beta) = 5 keeps
    # the gradient's per-pair weights 2 (h - 5) well away from 0, where fp32 noise in h would show).
    beta = {"simpo": "2.0", "ipo": "0.1"}.get(name, "0.5")
    if name == "rpo":
        return ("objective.name=dpo", f"objective.beta={beta}", "objective.rpo_alpha=1.0")
    return (f"objective.name={name}", f"objective.beta={beta}")


def build(spec: JobSpec, *, world: int = 1, gc: bool = False, precision: str = "fp32", wrap: bool = True):
    """The model with a seeded LoRA (B moved off zero, so the policy differs from the reference and
    every LoRA weight has a gradient), the loss module, DDP when world > 1, SGD(lr=1)."""
    model, tok = load_base_model(spec, precision)
    model = add_lora(model, spec, precision)
    if not spec.model.adapter:
        perturb_lora_b(model)
    if gc:
        enable_checkpointing(model)
    model.train()
    reference = REFERENCE_ADAPTER if REFERENCE_ADAPTER in model.peft_config else None
    module: nn.Module = PreferenceLoss(model, Objective.of(spec), reference_adapter=reference)
    if world > 1 and wrap:
        module = nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    return Engine(module, params, opt, scaler, torch.device("cpu"), precision, world), model, tok


def window(spec: JobSpec, tok, rank: int, world: int, step: int = 0):
    data = load_dataset(spec, tok)
    idx = GlobalBatches(len(data.train), spec.batch.global_batch_size, spec.run.seed).indices(step)
    mine = split_window(idx, rank, world, spec.batch.micro_batch_size, spec.grad_accum_steps)
    return [collate_pairs([data.train[i] for i in mb], tok.pad_token_id) for mb in mine], idx, data


# ---- the independent big-batch reference -------------------------------------------------------


def _seq_logp(model, prompt, response) -> torch.Tensor:
    """log p(response | prompt) from the full logits of the sequence alone."""
    ids = torch.tensor([list(prompt) + list(response)])
    logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    at = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logp[at, targets[at]].double().sum()


def _formula(
    name: str, beta: float, pw, pl, nw: int, nl: int, rw=None, rl=None, eps: float = 0.0, gamma=0.5, alpha: float = 0.0
):
    if name in ("dpo", "ipo"):
        h = (pw - rw) - (pl - rl)
        if name == "ipo":
            return (h - 1 / (2 * beta)) ** 2
        return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h) + alpha * (-pw / nw)
    aw, al = pw / nw, pl / nl
    if name == "simpo":
        return -F.logsigmoid(beta * (aw - al) - gamma)
    odds = (aw - torch.log(1 - torch.exp(aw))) - (al - torch.log(1 - torch.exp(al)))
    return -aw - beta * F.logsigmoid(odds)


def independent_grads(spec: JobSpec, precision: str = "fp32") -> tuple[dict, float]:
    """The big-batch gradient and loss, one pair and one sequence at a time (see module doc)."""
    one = spec.model_copy(deep=True)
    engine, model, tok = build(one, precision=precision)
    data = load_dataset(spec, tok)
    idx = GlobalBatches(len(data.train), spec.batch.global_batch_size, spec.run.seed).indices(0)
    obj = Objective.of(spec)
    losses = []
    for i in idx:
        p = data.train[i]
        with engine.autocast():
            pw, pl = _seq_logp(model, p.prompt, p.chosen), _seq_logp(model, p.prompt, p.rejected)
            rw = rl = None
            if obj.needs_reference:
                with torch.no_grad():
                    model.eval()
                    ctx = engine.module.reference_context()
                    with ctx:
                        rw, rl = _seq_logp(model, p.prompt, p.chosen), _seq_logp(model, p.prompt, p.rejected)
                    model.train()
        losses.append(
            _formula(
                obj.name,
                obj.beta,
                pw,
                pl,
                len(p.chosen),
                len(p.rejected),
                rw,
                rl,
                obj.label_smoothing or 0.0,
                obj.simpo_gamma,
                obj.rpo_alpha or 0.0,
            )
        )
    loss = torch.stack(losses).mean()
    loss.backward()
    return grads(model), float(loss.detach())


# ---- the split, on gloo ranks -------------------------------------------------------------------


def split_grads(rank: int, world: int, overrides: tuple, gc: bool, precision: str, strategy: str = "ddp"):
    """One window through `train_window`; this rank's gradient (unsharded) and the window loss."""
    spec = pref_spec(*overrides)
    engine, model, tok = build(spec, world=world, gc=gc, precision=precision, wrap=strategy == "ddp")
    if strategy == "fsdp":
        from jobs.train import fsdp

        module = fsdp.shard(engine.module, model, precision, True, torch.device("cpu"), world)
        params = [p for p in model.parameters() if p.requires_grad]
        engine = Engine(module, params, torch.optim.SGD(params, lr=1.0), engine.scaler, engine.device, precision, world)
    mbs, idx, _ = window(spec, tok, rank, world)
    sums = train_window(engine, mbs, len(idx))
    if world > 1:
        dist.all_reduce(sums)
    if engine.scaler.is_enabled():
        engine.scaler.unscale_(engine.optimizer)
    g = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    return g, float(sums[0]) / len(idx)


def _run_split(
    tmp_path: Path, w: int, overrides: tuple, gc: bool = False, precision: str = "fp32", strategy: str = "ddp"
):
    if w == 1:
        return split_grads(0, 1, overrides, gc, precision)
    per_rank = spawn(split_grads, w, tmp_path, overrides, gc, precision, strategy)
    assert rel_err(per_rank[1][0], per_rank[0][0]) == 0.0  # one reduced gradient on every rank
    return per_rank[0]


@pytest.mark.parametrize("w,m", SPLITS, ids=SPLIT_IDS)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_split_gives_the_big_batch_gradient(name, w, m, tmp_path):
    over = (*objective_overrides(name), f"resources.num_workers={w}", f"batch.micro_batch_size={m}")
    ref, ref_loss = independent_grads(pref_spec(*over))
    got, loss = _run_split(tmp_path, w, over)
    assert len(got) == len(ref) > 0
    assert rel_err(got, ref) <= 1e-5
    assert loss == pytest.approx(ref_loss, rel=1e-5)


def test_the_oracle_catches_a_token_normalization_and_a_sum_of_micro_batch_means():
    """Guards on the oracle itself: normalizing pair losses by label tokens (the DPO loss that
    grew with accumulation after transformers' accumulation fix, hiyouga/LlamaFactory#5747) and
    summing per-micro-batch means over accumulation steps are measurably wrong here. (A mean of
    per-micro-batch means is *right* for pairs: every micro-batch holds the same number of pairs.)"""
    over = (*objective_overrides("dpo"), "batch.micro_batch_size=2")
    spec = pref_spec(*over)
    ref, _ = independent_grads(spec)
    for wrong in ("tokens", "sum-of-micro-means"):
        engine, model, tok = build(spec)
        mbs, idx, data = window(spec, tok, 0, 1)
        n_tokens = sum(data.train[i].n_labels for i in idx)
        for mb in mbs:
            summed, _ = engine.module(**mb)
            (summed / n_tokens if wrong == "tokens" else summed / (len(mb["resp_len"]) // 2)).backward()
        assert rel_err(grads(model), ref) > 1e-3, wrong


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_checkpointing_and_fsdp_give_the_big_batch_gradient(name, tmp_path):
    over = (*objective_overrides(name), "resources.num_workers=2", "batch.micro_batch_size=2")
    ref, ref_loss = independent_grads(pref_spec(*over))
    for i, (gc, strategy) in enumerate([(True, "ddp"), (False, "fsdp"), (True, "fsdp")]):
        got, loss = _run_split(tmp_path / str(i), 2, over, gc=gc, strategy=strategy)
        assert rel_err(got, ref) <= 1e-5, (gc, strategy)
        assert loss == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.slow
def test_an_nf4_base_and_the_fp16_scaler_stay_within_their_bounds(tmp_path):
    """bf16 on an nf4 base (bound 2e-2, tests/integration/test_qlora.py's) and fp16 with the GradScaler (bound
    2e-2, tests/unit/train/test_accumulation.py's; unscaling twice or never is off by 65536)."""
    over = (*objective_overrides("dpo"), "resources.num_workers=2", "batch.micro_batch_size=2")
    nf4 = (*over, "model.quantization=nf4")
    ref, _ = independent_grads(pref_spec(*nf4), precision="bf16")
    got, _ = _run_split(tmp_path / "nf4", 2, nf4, gc=True, precision="bf16")
    assert rel_err(got, ref) <= 2e-2
    assert rel_err(got, independent_grads(pref_spec(*over))[0]) > 2e-2  # the nf4 base is another model
    ref16, _ = independent_grads(pref_spec(*over), precision="fp16")
    got16, _ = _run_split(tmp_path / "fp16", 2, over, precision="fp16")
    assert rel_err(got16, ref16) <= 2e-2


# ---- one reduction per step -------------------------------------------------------------------------


def _count_allreduces(rank: int, world: int, micro: int):
    spec = pref_spec(*objective_overrides("dpo"), f"resources.num_workers={world}", f"batch.micro_batch_size={micro}")
    engine, model, tok = build(spec, world=world)
    calls = {"n": 0}

    def hook(state, bucket):
        calls["n"] += 1
        t = bucket.buffer().div_(world)
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    engine.module.register_comm_hook(None, hook)
    per_step = []
    for step in range(2):
        mbs, idx, _ = window(spec, tok, rank, world, step=step)
        before = calls["n"]
        train_window(engine, mbs, len(idx))
        per_step.append(calls["n"] - before)
        engine.optimizer.zero_grad(set_to_none=True)
    return per_step, spec.grad_accum_steps


def test_one_allreduce_per_optimizer_step_with_the_reference_forward_inside(tmp_path):
    base, n1 = spawn(_count_allreduces, 2, tmp_path / "a", 4)[0]
    per_step, n4 = spawn(_count_allreduces, 2, tmp_path / "b", 1)[0]
    assert n1 == 1 and n4 == 4
    buckets = base[0]
    assert buckets >= 1 and per_step == [buckets, buckets], "one all-reduce per optimizer step, not per micro-step"


# ---- the reference ---------------------------------------------------------------------------------


def test_precomputed_reference_equals_the_reference_forward():
    spec = pref_spec(*objective_overrides("dpo"))
    engine, model, tok = build(spec)
    mbs, _, _ = window(spec, tok, 0, 1)
    for mb in mbs:
        ref = engine.module(**mb, reference_only=True)
        with torch.no_grad():
            a, sa = engine.module(**mb)
            b, sb = engine.module(**mb, ref_logps=ref)
        assert torch.equal(a, b) and torch.equal(sa, sb)
        # The reference is the base alone: LoRA B was moved off zero, so the policy differs.
        assert not torch.allclose(ref, engine.module.sequence_logps(mb["input_ids"], mb["label_pos"], mb["label_ids"]))


def _train(out: Path, *overrides: str) -> dict:
    from jobs.spec import absolutize
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    spec = absolutize(pref_spec(f"run.output_dir={out}", *overrides))
    return train(spec, LocalContext(on_progress=lambda r: None), resume=True)


def _metrics(out: Path) -> list[dict]:
    from runs import metric_lines

    return metric_lines(out)


def test_precomputed_runs_train_the_same_steps_and_reuse_the_stored_values(tmp_path, caplog):
    common = (*objective_overrides("dpo"), "run.max_steps=3", f"data.eval_path={PAIRS_EVAL}")
    _train(tmp_path / "live", *common)
    with caplog.at_level("WARNING", logger="rayft"):
        _train(tmp_path / "pre", *common, "objective.reference=precomputed")
        _train(tmp_path / "pre2", *common, "objective.reference=precomputed", "objective.beta=0.2")
    computed = [r.getMessage() for r in caplog.records if "reference log-probabilities of" in r.getMessage()]
    assert len(computed) == 1, computed  # the second run (another beta) reused the stored values
    live, pre = _metrics(tmp_path / "live"), _metrics(tmp_path / "pre")
    # The reference log-probs are sums over ~30 tokens (~200 nats) computed in micro-batches of
    # other shapes (other padding) than the step's, so they agree to fp32 rounding: ~1e-7 of 200
    # nats, times beta, in the rewards (absolute); the loss and gradient norm to 1e-5 relative.
    for a, b in zip(live, pre, strict=True):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        for key in ("rewards/chosen", "rewards/margins"):
            assert b[key] == pytest.approx(a[key], abs=2e-5), (a["step"], key)
    assert live[-1]["eval_loss"] == pytest.approx(pre[-1]["eval_loss"], rel=1e-5)
    assert "eval_rewards/accuracies" in live[-1] and "rewards/chosen" in live[0]


def test_the_starting_adapter_is_the_dpo_reference(tmp_path):
    """SFT, then DPO from its adapter: the policy starts equal to its reference, so the first
    step's loss is log 2 on every pair and every reward is 0; the base with the adapter off would
    be another reference."""
    from jobs.spec import absolutize
    from jobs.spec import load_spec as load

    sft_out = tmp_path / "sft"
    sft = absolutize(
        load(
            "examples/tiny-lora.yaml",
            [
                f"run.output_dir={sft_out}",
                "run.max_steps=2",
                "resources.num_workers=1",
                "lora.r=4",
                "lora.alpha=8",
                "run.eval_every=0",
                "memory.gradient_checkpointing=false",
            ],
        )
    )
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    train(sft, LocalContext(on_progress=lambda r: None), resume=False)
    adapter = sft_out / "adapter"
    start = pref_spec(*objective_overrides("dpo"), f"model.adapter={adapter}")
    engine, model, tok = build(start)
    assert REFERENCE_ADAPTER in model.peft_config and engine.module.reference_adapter == REFERENCE_ADAPTER
    mbs, idx, _ = window(start, tok, 0, 1)
    with torch.no_grad():
        total = sum(float(engine.module(**mb)[0]) for mb in mbs)
    assert total / len(idx) == pytest.approx(math.log(2), rel=1e-6)
    # Against the bare base the SFT adapter's log-probs differ: that reference would not give log 2.
    mb = mbs[0]
    with torch.no_grad(), model.disable_adapter():
        bare = engine.module.sequence_logps(mb["input_ids"], mb["label_pos"], mb["label_ids"])
    assert not torch.allclose(bare, engine.module.reference_logps(mb["input_ids"], mb["label_pos"], mb["label_ids"]))
    summary = _train(tmp_path / "dpo", *objective_overrides("dpo"), f"model.adapter={adapter}", "run.max_steps=2")
    assert summary["objective"] == "dpo"
    assert not (tmp_path / "dpo" / "adapter" / REFERENCE_ADAPTER).exists()  # only the trained adapter is saved


def test_a_dpo_run_resumes_bitwise(tmp_path):
    from gradtools import final_adapter

    # A constant lr: the schedule of a 2-step run would differ from the first 2 steps of a 4-step one.
    common = (
        *objective_overrides("dpo"),
        "run.checkpoint_every=2",
        "run.keep_checkpoints=4",
        "optim.schedule=constant",
    )
    _train(tmp_path / "straight", *common, "run.max_steps=4")
    _train(tmp_path / "resumed", *common, "run.max_steps=2")
    _train(tmp_path / "resumed", *common, "run.max_steps=4")
    a, b = final_adapter(tmp_path / "straight"), final_adapter(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in _metrics(tmp_path / "straight")] == [r["loss"] for r in _metrics(tmp_path / "resumed")]


def test_trl_metric_names_reach_metrics_jsonl_and_tensorboard(tmp_path):
    """Per step: the loss and TRL's rewards/* and logps/*; on eval (every 2 steps): eval_loss and
    eval_rewards/*; TensorBoard gets each eval value only at the steps it was measured."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    _train(
        out,
        *objective_overrides("dpo"),
        "run.max_steps=4",
        "run.eval_every=2",
        f"data.eval_path={PAIRS_EVAL}",
        "run.trackers=[tensorboard]",
    )
    records = _metrics(out)
    names = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    )
    for r in records:
        assert all(isinstance(r[k], float) for k in names)
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-9)
        assert 0.0 <= r["rewards/accuracies"] <= 1.0
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("rewards/accuracies")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval_rewards/accuracies")] == [2, 4]
    assert [e.value for e in acc.Scalars("eval_rewards/margins")] == pytest.approx(
        [records[1]["eval_rewards/margins"], records[3]["eval_rewards/margins"]]
    )


def test_the_starting_adapter_key_hashes_what_peft_reads_streamed(tmp_path, monkeypatch):
    """The reference key's adapter part: the files PEFT reads, hashed in blocks (a 1 GB junk file
    named `adapter_model*` beside them raised the peak memory by 2 GB: it was read whole)."""
    from jobs.model.adapter_check import adapter_digest as _adapter_digest

    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    before = _adapter_digest(str(tmp_path))
    (tmp_path / "adapter_model.old").write_bytes(b"junk" * 1000)  # not read by PEFT
    (tmp_path / "adapter_config.json.bak").write_text("{}")
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} read whole"))
    assert _adapter_digest(str(tmp_path)) == before
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights" * 101)
    assert _adapter_digest(str(tmp_path)) != before
