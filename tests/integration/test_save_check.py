"""Every save is whole (issue 49): a run's adapter loads in a fresh process and computes the trained
model's logits; a save that is not whole is one line, exit 1.

* An FSDP DPO run with gradient checkpointing (2 gloo ranks) saves every LoRA tensor. Before the
  fix PEFT's `disable_adapter()` left the LoRA shards frozen and the saved adapter held no tensor.
* The matrix: each run's `adapter/` is loaded with `PeftModel.from_pretrained` in a fresh process,
  whose logits on a probe equal the trained model's (taken inside the run, after its last step,
  on every rank: an FSDP forward is a collective), while the base's logits are far from them.
* `jobs.run.save_check` refuses an empty, short, damaged or unreadable save in one `RunError` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gradtools import ROOT, spawn, tiny_spec

from jobs.errors import RunError
from jobs.run import save_check

PAIRS = str(ROOT / "examples" / "data" / "tiny-pairs.jsonl")
PROBE = "probe.pt"
# 1 optimizer step of 4 sequences (pairs: 2 x 2 rows) per run, lr high enough that the adapter
# moves the logits far more than the precisions' rounding does (checked: `effect` below).
RUN = ["run.max_steps=1", "run.eval_every=0", "batch.global_batch_size=4", "batch.micro_batch_size=2", "optim.lr=0.05"]


# GRPO: 4 completions of one prompt scored by a reward that differs within the group from the
# first step (so the advantages, and the update, are not zero).
GRPO = (
    f"reward.functions=[{{fn: '{ROOT / 'examples' / 'rewards' / 'tiny.py'}:letters'}}]",
    "rollout.num_generations=4",
    "rollout.max_completion_length=8",
)


def _case(strategy: str, objective: str, gc: bool, precision: str, extra: tuple = ()) -> tuple:
    data = [f"data.path={PAIRS}"] if objective not in ("sft", "grpo") else []
    extra = (*GRPO, *extra) if objective == "grpo" else extra
    over = [
        f"resources.strategy={strategy}",
        f"objective.name={objective}",
        f"memory.gradient_checkpointing={str(gc).lower()}",
        f"precision={precision}",
    ]
    return tuple(RUN + data + over + list(extra))


# The covering subset of strategy (2) x objective (6) x checkpointing (2) x precision (fp32, bf16,
# fp16; nf4 on a CPU too): the full product is 60+ runs (~8 s each on 2 cores), this is 13. Every
# (strategy, objective) pair runs once; checkpointing and precision alternate so that each strategy
# meets every precision and both checkpointing settings, and every preference objective runs under
# FSDP with checkpointing or a reduced precision; both references (adapter_off, precomputed) run
# under each strategy; nf4 (QLoRA) runs under FSDP with DPO and checkpointing, the case.
CASES = {
    "fsdp-dpo-gc-fp32": _case("fsdp", "dpo", True, "fp32"),  # the case
    "fsdp-ipo-gc-bf16-precomputed": _case("fsdp", "ipo", True, "bf16", ("objective.reference=precomputed",)),
    "fsdp-simpo-fp16": _case("fsdp", "simpo", False, "fp16"),
    "fsdp-orpo-gc-fp32": _case("fsdp", "orpo", True, "fp32"),
    "fsdp-sft-bf16": _case("fsdp", "sft", False, "bf16"),
    "ddp-dpo-bf16-precomputed": _case("ddp", "dpo", False, "bf16", ("objective.reference=precomputed",)),
    "ddp-ipo-gc-fp32": _case("ddp", "ipo", True, "fp32"),
    "ddp-simpo-gc-bf16": _case("ddp", "simpo", True, "bf16"),
    "ddp-orpo-fp16": _case("ddp", "orpo", False, "fp16"),
    "ddp-sft-gc-fp16": _case("ddp", "sft", True, "fp16"),
    "fsdp-dpo-gc-nf4": _case("fsdp", "dpo", True, "fp32", ("model.quantization=nf4",)),
    "fsdp-grpo-gc-fp32": _case("fsdp", "grpo", True, "fp32"),
    "ddp-grpo-bf16": _case("ddp", "grpo", False, "bf16"),  # generation under the run's autocast
}
# How far the fresh process's logits may be from the trained model's, relative to how far the adapter
# moves them (||fresh - trained|| / ||trained - base||: an adapter that is not there scores 1).
# fp32 (and nf4's fp32 compute): exact, measured 0. bf16 / fp16 (trained under autocast, FSDP's
# gathered weights in that dtype; the fresh process under the same autocast): the dtype's rounding,
# measured 0.058-0.062 and 0.0070-0.0078 (2.0-2.2% and 0.25% of the logits themselves, the 8x of
# bf16's 3 fewer mantissa bits).
TOLERANCE = {"fp32": 1e-5, "bf16": 0.15, "fp16": 0.02}


def _probe_ids() -> torch.Tensor:
    return torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _probe(model, precision: str, out: Path) -> None:
    """Every rank: the model's logits on the probe, adapter on and off, in the run's precision."""
    from jobs.objectives.preference import adapters_off

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    cast = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    was = model.training
    model.eval()
    with torch.no_grad(), cast:
        adapted = model(input_ids=_probe_ids()).logits.float()
        with adapters_off(model):
            base = model(input_ids=_probe_ids()).logits.float()
    model.train(was)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"adapted": adapted, "base": base}, out / PROBE)


def _train_and_probe(rank: int, world: int, overrides: tuple, out: str) -> dict:
    """`jobs.train.loop.train` of `overrides` on this rank (no Ray); the trained model is probed where
    the loop takes the trained state at the end (`save_check.trained_state`, every rank)."""
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    spec = tiny_spec(*overrides, f"resources.num_workers={world}", f"run.output_dir={out}")
    real = save_check.trained_state

    def probing(model, optimizer):
        state = real(model, optimizer)
        _probe(model, spec.precision, Path(out))
        return state

    save_check.trained_state = probing
    try:
        return train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    finally:
        save_check.trained_state = real


def _precision_of(overrides) -> str:
    return next(o.split("=")[1] for o in overrides if o.startswith("precision="))


def _fresh_base(adapter: str, overrides: list):
    """The base as the adapter's config names it; an nf4 run's quantized as the run's was."""
    from transformers import AutoModelForCausalLM

    from jobs.model.loading import load_base_model

    if "model.quantization=nf4" in overrides:
        return load_base_model(tiny_spec(*overrides, "resources.num_workers=2"), "fp32")[0]
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    return AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])


def fresh_logits(todo: str) -> None:
    """In a fresh process: each adapter of `todo` ({case: [adapter dir, overrides]}, JSON) loaded
    with `PeftModel.from_pretrained`; its logits on the probe, under the run's autocast, saved
    beside it."""
    from peft import PeftModel

    for adapter, overrides in json.loads(todo).values():
        model = PeftModel.from_pretrained(_fresh_base(adapter, overrides), adapter).eval()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(_precision_of(overrides))
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            torch.save(model(input_ids=_probe_ids()).logits.float(), Path(adapter) / "fresh-logits.pt")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, Path]:
    """Every case of CASES trained on 2 gloo ranks (the session's pool), then every adapter
    loaded in one fresh Python process: {case: run directory}."""
    tmp = tmp_path_factory.mktemp("save-matrix")
    runs = {}
    for name, overrides in CASES.items():
        spawn(_train_and_probe, 2, tmp / f"s-{name}", overrides, str(tmp / name))
        runs[name] = tmp / name
    todo = {name: (str(out / "adapter"), list(CASES[name])) for name, out in runs.items()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "helpers")]))
    code = "import sys; from tests.integration.test_save_check import fresh_logits; fresh_logits(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, json.dumps(todo)], check=True, env=env, cwd=ROOT, timeout=600)
    return runs


def _lora_tensors(out: Path) -> dict[str, torch.Tensor]:
    return save_check.read_back(out / "adapter" / "adapter_model.safetensors")


def test_an_fsdp_dpo_run_with_checkpointing_saves_every_lora_tensor(matrix):
    """Issue 49's case: 2 FSDP workers, DPO with the adapter off as reference, checkpointing on.
    tiny-llama has 2 layers x 7 LoRA targets, each with A and B: 28 tensors (it saved none)."""
    from jobs.run.checkpoint import load_adapter, newest_complete

    out = matrix["fsdp-dpo-gc-fp32"]
    saved = _lora_tensors(out)
    assert len(saved) == 28 and all("lora_" in k for k in saved)
    assert len(load_adapter(newest_complete(out / "checkpoints"))) == 28


@pytest.mark.parametrize("name", list(CASES))
def test_the_saved_adapter_computes_the_trained_logits_in_a_fresh_process(matrix, name):
    out = matrix[name]
    probe = torch.load(out / PROBE)
    fresh = torch.load(out / "adapter" / "fresh-logits.pt")
    effect = float((probe["adapted"] - probe["base"]).norm())
    rel = float((fresh - probe["adapted"]).norm()) / effect
    precision = _precision_of(CASES[name])
    assert rel <= TOLERANCE[precision], (name, rel)
    assert effect >= 0.2 * float(probe["adapted"].norm()), (name, effect)  # the adapter moves the logits
    assert json.loads((out / "summary.json").read_text())["strategy"] == name.split("-")[0]


# ---- a save that is not whole --------------------------------------------------------------------


def _one_line_run_error(exc: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(exc.value)
    assert exc.value.exit_code == 1 and "\n" not in msg, msg
    assert all(w in msg for w in words), msg
    return msg


def test_an_empty_short_or_changed_state_is_refused_in_one_line():
    trained = {"a.lora_A.weight": torch.ones(2, 3), "a.lora_B.weight": torch.zeros(3, 2)}
    with pytest.raises(RunError) as e:
        save_check.check_state({}, trained, "checkpoint step-00000001")
    _one_line_run_error(e, "checkpoint step-00000001", "holds 0 tensors where 2 were trained", "missing a.lora_A")
    with pytest.raises(RunError) as e:
        save_check.check_state({**trained, "a.lora_A.weight": torch.ones(3, 2)}, trained, "adapter")
    _one_line_run_error(e, "a.lora_A.weight is torch.float32 (3, 2), trained torch.float32 (2, 3)")
    with pytest.raises(RunError) as e:
        save_check.check_state({**trained, "a.lora_B.weight": torch.full((3, 2), 1e-7)}, trained, "adapter")
    _one_line_run_error(e, "a.lora_B.weight differs from the trained value (max |diff| 1e-07)")
    save_check.check_state({**trained, "a.lora_B.weight": torch.ones(3, 2)}, trained, "adapter", values=False)


def test_a_checkpoint_file_that_does_not_read_back_whole_is_refused(tmp_path, monkeypatch):
    """`write_rank_files` reads the adapter file back before its manifest is written: a write cut
    short is one RunError line naming the file, and no manifest vouches for it."""
    import safetensors.torch

    from jobs.run import checkpoint as ckpt

    real = safetensors.torch.save_file

    def cut_short(tensors, path, *a, **kw):
        real(tensors, path, *a, **kw)
        os.truncate(path, os.path.getsize(path) - 8)

    monkeypatch.setattr(safetensors.torch, "save_file", cut_short)
    files = ckpt.rank_files(0, {"step": 1}, {"x.lora_A.weight": torch.ones(4, 4)}, {}, None)
    with pytest.raises(RunError) as e:
        ckpt.write_rank_files(tmp_path, 0, files)
    _one_line_run_error(e, str(tmp_path / ckpt.ADAPTER_FILE), "cannot be read back")
    assert not (tmp_path / ckpt.manifest_file(0)).exists()


def test_a_run_whose_final_adapter_comes_out_empty_exits_1_in_one_line(tmp_path, monkeypatch):
    """The issue's symptom, forced on one process: the gathered adapter state is empty. The run
    stops with one RunError line before summary.json says it finished."""
    from jobs.train import fsdp
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    monkeypatch.setattr(fsdp, "full_adapter", lambda model: {})
    spec = tiny_spec("run.max_steps=1", "run.eval_every=0", "resources.num_workers=1", f"run.output_dir={tmp_path}")
    with pytest.raises(RunError) as e:
        train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    _one_line_run_error(e, str(tmp_path / "adapter"), "holds 0 tensors where 28 were trained")
    assert not (tmp_path / "summary.json").exists()


def test_an_export_that_does_not_read_back_as_its_source_exits_1_in_one_line(matrix, tmp_path, monkeypatch, capsys):
    """`rayft export` reads the copied weights back: a copy that came out changed is exit 1, one
    line, and no export; the merged export of the same run reads back whole."""
    import shutil

    from orchestrator.cli import main

    run = matrix["ddp-sft-gc-fp16"]
    assert main(["export", str(run), "--merge", "--to", str(tmp_path / "merged")]) == 0
    real = shutil.copytree

    def damaging(src, dst, **kw):
        real(src, dst, **kw)
        weights = Path(dst) / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x40
        weights.write_bytes(bytes(data))

    monkeypatch.setattr(shutil, "copytree", damaging)
    capsys.readouterr()
    assert main(["export", str(run), "--to", str(tmp_path / "copy")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "adapter_model.safetensors" in err and "differs" in err, err
    assert not (tmp_path / "copy").exists()


def test_adapters_off_gives_the_base_and_leaves_every_requires_grad_as_it_was():
    """The reference switch (`adapters_off`) computes what PEFT's `disable_adapter()` computes, and
    changes no parameter's `requires_grad` (PEFT's froze the adapter on entry: under FSDP the shards
    stayed frozen, issue 49)."""
    from gradtools import build_engine

    from jobs.objectives.preference import adapters_off

    _, model, _ = build_engine(tiny_spec(), optimizer=False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        with model.disable_adapter():
            want = model(input_ids=_probe_ids()).logits
        with adapters_off(model):
            assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
            got = model(input_ids=_probe_ids()).logits
        adapted = model(input_ids=_probe_ids()).logits
    assert torch.equal(got, want) and not torch.equal(adapted, want)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
