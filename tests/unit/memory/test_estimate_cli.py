"""`rayft estimate`: the component table and the feasible (micro-batch, accumulation) pairs,
consistent with jobs.memory; JSON for tools; bad input is one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from gradtools import DATA

from jobs import memory
from jobs.spec import load_spec
from orchestrator.cli import main

GIB = 1024**3
BASE = {
    "name": "est",
    "data": {"path": str(DATA), "max_seq_len": 64},
    "lora": {"r": 4, "alpha": 8},
    "batch": {"global_batch_size": 16, "micro_batch_size": 4},
    "memory": {"gradient_checkpointing": "auto"},
    "resources": {"num_workers": 2},
    "run": {"max_steps": 1},
}


def _budget() -> float:
    """Between micro-batch 4 with and without checkpointing, from jobs.memory itself."""
    spec = load_spec(data=BASE)
    off = memory.estimate_for_spec(spec, gradient_checkpointing=False, device="cpu").total_gib
    on = memory.estimate_for_spec(spec, gradient_checkpointing=True, device="cpu").total_gib
    assert on < off
    return round((on + off) / 2, 6)


BUDGET = _budget()
BASE["memory"]["budget_gib"] = BUDGET


def _write(tmp_path: Path, data: dict, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def test_json_components_and_pairs_agree_with_jobs_memory(tmp_path, capsys):
    path = _write(tmp_path, BASE)
    rep = _json(capsys, ["estimate", str(path), "--json"])
    spec = load_spec(path)
    off = memory.estimate_for_spec(spec, gradient_checkpointing=False, device="cpu")
    on = memory.estimate_for_spec(spec, gradient_checkpointing=True, device="cpu")

    # every component jobs.memory names, in bytes, for both checkpointing settings
    assert set(memory.COMPONENT_ORDER) <= set(rep["components"])
    assert rep["by_checkpointing"]["off"]["components"] == off.components
    assert rep["by_checkpointing"]["on"]["components"] == on.components
    assert rep["by_checkpointing"]["off"]["total_bytes"] == off.total_bytes
    # `auto`: checkpointing only when off exceeds the budget (BUDGET lies between the two), then
    # the sparsest every-k-th-layer choice that fits: the plan jobs.train.loop runs
    assert off.total_gib > BUDGET >= on.total_gib
    every = memory.plan_for_spec(spec, device="cpu").checkpoint_every_n_layers
    chosen = memory.estimate_for_spec(spec, gradient_checkpointing=True, checkpoint_every_n_layers=every, device="cpu")
    assert rep["checkpointing_used"] is True and rep["checkpoint_every_n_layers"] == every >= 1
    assert rep["components"] == chosen.components
    assert rep["total_bytes"] == chosen.total_bytes and rep["fits"] is True
    assert rep["device"] == "cpu" and rep["precision"] == "fp32" and rep["seq_len"] == 63

    # the pairs: every split of 16 over 2 workers, checkpointing off and on, as jobs.memory lists them
    pairs = rep["pairs"]
    assert [{k: v for k, v in r.items() if k != "estimate_bytes"} for r in pairs] == memory.feasible_pairs(
        spec, BUDGET, device="cpu"
    )
    assert sorted({r["micro_batch_size"] for r in pairs}) == _divisors(8)
    assert len(pairs) == 2 * len(_divisors(8))
    for r in pairs:
        assert r["micro_batch_size"] * r["grad_accum_steps"] * 2 == 16  # multiplies back to the global batch
        exact = memory.estimate_for_spec(
            spec,
            micro_batch_size=r["micro_batch_size"],
            gradient_checkpointing=r["gradient_checkpointing"],
            device="cpu",
        )
        assert r["estimate_bytes"] == exact.total_bytes
        assert r["fits"] == (exact.total_gib <= BUDGET)
    fits = {(r["micro_batch_size"], r["gradient_checkpointing"]) for r in pairs if r["fits"]}
    assert (1, True) in fits and (4, True) in fits and (4, False) not in fits and (8, False) not in fits
    assert rep["smallest_budget_gib"] == pytest.approx(memory.smallest_budget_gib(spec, device="cpu"))


def test_overrides_device_and_search_specs(tmp_path, capsys):
    path = _write(tmp_path, BASE)
    rep = _json(
        capsys,
        ["estimate", str(path), "--json", "batch.global_batch_size=12", "batch.micro_batch_size=2", "--device", "cuda"],
    )
    assert rep["global_batch_size"] == 12 and rep["device"] == "cuda" and rep["precision"] == "bf16"
    assert sorted({r["micro_batch_size"] for r in rep["pairs"]}) == [1, 2, 3, 6]
    assert all(r["micro_batch_size"] * r["grad_accum_steps"] * 2 == 12 for r in rep["pairs"])
    assert rep["components"]["framework_overhead"] >= memory.CUDA_CONTEXT_BYTES  # the CUDA context counts
    assert not any(r["fits"] for r in rep["pairs"])  # a few MiB cannot hold a CUDA context

    # a search spec: its job part, with search.budget_gib as the budget
    search = dict(
        BASE,
        data=dict(BASE["data"], eval_path=str(DATA)),
        run={},
        search={"grad_accum_steps": [1, 2], "budget_gib": 0.5, "samples_per_trial": 16},
    )
    rep = _json(capsys, ["estimate", str(_write(tmp_path, search, "search.yaml")), "--json"])
    assert rep["budget_gib"] == 0.5 and all(r["fits"] for r in rep["pairs"])


def test_human_output_has_the_table_the_total_against_the_budget_and_the_pairs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich folds long titles at 80 columns otherwise
    path = _write(tmp_path, BASE)
    assert main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    for name in memory.COMPONENT_ORDER:
        assert name in out
    assert "total" in out and "fits the budget" in out and f"{BUDGET * 1024:.2f} MiB" in out
    assert "pairs for global batch 16 over 2 worker(s)" in out and "over" in out
    assert main(["estimate", str(path), "memory.budget_gib=0.001", "memory.gradient_checkpointing=false"]) == 0
    assert "exceeds the budget" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["batch.foo=1"], "batch.foo: unknown key"),
        (["batch.micro_batch_size=0"], "batch.micro_batch_size: Input should be greater than 0"),
        (["batch.micro_batch_size=3"], "batch.global_batch_size=16 is not divisible by batch.micro_batch_size=3"),
        (["lora.target_modules=[attn]"], "lora target modules ['attn'] are not linear layers"),
        (["model.name=./no-such-model"], "model.name: cannot read the model config"),
        (["memory.budget_gib=-1"], "memory.budget_gib: Input should be greater than 0"),
        (["nodots"], "unrecognized arguments: nodots"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, fragment):
    path = _write(tmp_path, BASE)
    try:
        rc = main(["estimate", str(path), "--json", *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    cap = capsys.readouterr()
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err, cap.err
    assert fragment in lines[0], lines[0]
    assert cap.out == ""


def test_missing_spec_file(tmp_path, capsys):
    assert main(["estimate", str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err.strip() == f"rayft: error: {tmp_path / 'absent.yaml'}: spec file not found"


def test_packing_is_estimated_as_full_packed_rows(tmp_path, capsys):
    """data.packing: rows of max_seq_len tokens carrying the shared block mask, so the estimate
    is above the unpacked one by at least that bias, and says which row length it assumed."""
    path = _write(tmp_path, BASE)
    plain = _json(capsys, ["estimate", str(path), "--json", "memory.gradient_checkpointing=false"])
    packed = _json(
        capsys, ["estimate", str(path), "--json", "memory.gradient_checkpointing=false", "data.packing=true"]
    )
    spec = load_spec(path)
    S, B = spec.data.max_seq_len, spec.batch.micro_batch_size
    assert plain["seq_len"] == S - 1 and packed["seq_len"] == S
    bias = B * S * S * 4  # fp32 on CPU
    assert packed["components"]["activations"] - plain["components"]["activations"] >= bias
    assert main(["estimate", str(path), "data.packing=true"]) == 0
    assert f"x seq {S} (packed rows)" in capsys.readouterr().out


def test_a_preference_spec_shows_its_pairs_and_its_reference(tmp_path, capsys, monkeypatch):
    """objective.name=dpo starting from model.adapter: the JSON components are the plan's, with the
    reference adapter and the reference forward (a transient); a micro-batch of 4 pairs has the
    activations of 8 rows; precomputed reference log-probabilities drop the forward, SimPO both."""
    path = _write(tmp_path, BASE)
    dpo = ["objective.name=dpo", "model.adapter=outputs/sft/adapter"]
    rep = _json(capsys, ["estimate", str(path), "--json", *dpo])
    plan = memory.plan_for_spec(load_spec(path, dpo, files=False), device="cpu")
    assert rep["components"] == plan.estimate.components and rep["total_bytes"] == plan.estimate.total_bytes
    assert set(memory.REFERENCE_COMPONENTS) <= set(rep["components"])
    assert "reference_forward" in rep["transient_components"]
    rows8 = memory.estimate_for_spec(
        load_spec(path, ["batch.micro_batch_size=8"], files=False), gradient_checkpointing=False, device="cpu"
    )
    assert rep["by_checkpointing"]["off"]["components"]["activations"] == rows8.components["activations"]
    pre = _json(capsys, ["estimate", str(path), "--json", "objective.name=dpo", "objective.reference=precomputed"])
    simpo = _json(
        capsys, ["estimate", str(path), "--json", "objective.name=simpo", "model.adapter=outputs/sft/adapter"]
    )
    assert "reference_forward" not in pre["components"] and "reference_adapter" not in pre["components"]
    assert not set(memory.REFERENCE_COMPONENTS) & set(simpo["components"])
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["estimate", str(path), *dpo]) == 0
    out = capsys.readouterr().out
    assert "reference_forward (transient)" in out and "reference_adapter" in out


# ---- a base bigger than one GPU: examples/llama70b-lora.yaml ------------------------------------

ROOT = Path(__file__).resolve().parents[3]
BIG = ROOT / "examples" / "llama70b-lora.yaml"


def _big(capsys, *overrides) -> dict:
    """The 70B example (its model.name is a directory with only config.json), from any cwd."""
    return _json(
        capsys, ["estimate", str(BIG), "--json", f"model.name={ROOT / 'examples' / 'llama3-70b-shape'}", *overrides]
    )


def _rows(rep: dict) -> dict:
    return {(r["strategy"], r["quantization"]): r for r in rep["strategies"]}


def test_70b_needs_fsdp_over_eight_h100s_or_nf4_on_fewer(capsys, monkeypatch):
    rep = _big(capsys)
    rows = _rows(rep)
    assert rep["num_workers"] == 8 and rep["budget_gib"] <= 80 and rep["device"] == "cuda"  # 8 x H100 80GB
    params = sum(
        memory.count_base_params(
            memory.model_shape(
                memory.config_from_spec(
                    load_spec(BIG, [f"model.name={ROOT / 'examples' / 'llama3-70b-shape'}"], files=False)
                )
            )
        ).values()
    )
    assert 70e9 < params < 71e9

    # DDP: every GPU holds the whole bf16 base; it does not fit even checkpointing every layer
    ddp = rows["ddp", "none"]
    assert ddp["fits"] is False and ddp["checkpointing"] == "on" and not ddp["chosen"]
    assert ddp["components"]["frozen_weights"] == 2 * params and ddp["total_gib"] > rep["budget_gib"]
    # FSDP over 8: an eighth of the base per GPU (plus padding); it fits, and the plan chose it
    fsdp = rows["fsdp", "none"]
    assert fsdp["fits"] is True and fsdp["chosen"] and fsdp["reshard_after_forward"] is True
    assert 2 * params / 8 <= fsdp["components"]["frozen_weights"] < 1.001 * 2 * params / 8
    assert (rep["strategy"], rep["fits"], rep["total_bytes"]) == ("fsdp", True, fsdp["total_bytes"])

    # QLoRA nf4 on 2 GPUs (and on 1): DDP with a 4-bit base fits where bf16 fits neither way
    for workers in (2, 1):
        q = _big(capsys, "model.quantization=nf4", f"resources.num_workers={workers}")
        qrows = _rows(q)
        assert qrows["ddp", "nf4"]["fits"] is True and qrows["ddp", "nf4"]["chosen"]
        assert (q["strategy"], q["quantization"], q["fits"], q["num_workers"]) == ("ddp", "nf4", True, workers)
        assert qrows["ddp", "none"]["fits"] is False
        # Over 2 workers the 4-bit base could be sharded too (it fits; DDP, tried first, was chosen);
        # one worker has nothing to shard over.
        assert workers == 1 or qrows["fsdp", "none"]["fits"] is False
        assert (("fsdp", "nf4") in qrows) == (workers == 2)
        if workers == 2:
            fsdp_q = qrows["fsdp", "nf4"]
            assert fsdp_q["fits"] is True and not fsdp_q["chosen"]
            assert fsdp_q["components"]["frozen_weights"] < qrows["ddp", "nf4"]["components"]["frozen_weights"]
        assert q["components"]["frozen_weights"] < 0.3 * ddp["components"]["frozen_weights"]

    # the same, for people: DDP and FSDP side by side, which fits and which the plan chose
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["estimate", str(BIG), f"model.name={ROOT / 'examples' / 'llama3-70b-shape'}"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("per GPU by strategy") : out.index("(micro_batch_size")]
    ddp_line = next(line for line in table.splitlines() if "ddp" in line)
    fsdp_line = next(line for line in table.splitlines() if "fsdp" in line)
    assert "exceeds" in ddp_line and "chosen" not in ddp_line
    assert "fits" in fsdp_line and "chosen" in fsdp_line
    assert "(fsdp, checkpointing" in out


def test_a_grpo_spec_shows_its_generation_and_the_chosen_generation_batch(tmp_path, capsys, monkeypatch):
    """`rayft estimate` on a GRPO spec: the generation transient among the components, the plan's
    generation batch and the parts of generation's peak (JSON and text); a fixed batch is the
    spec's; SFT has no generation."""
    grpo = ROOT / "examples" / "tiny-grpo.yaml"
    rep = _json(capsys, ["estimate", str(grpo), "--json"])
    plan = memory.plan_for_spec(load_spec(grpo, files=False), device="cpu")
    gen = rep["generation"]
    assert rep["components"] == plan.estimate.components and "generation" in rep["transient_components"]
    assert gen["generation_batch_size"] == plan.generation_batch_size and gen["chosen_by_plan"]
    assert gen["bytes"]["peak_bytes"] == rep["components"]["generation"] and gen["share"] == 8
    assert gen["bytes"]["kv_cache"] == memory.kv_cache_bytes(
        memory.model_shape(memory.config_from_spec(plan_spec := load_spec(grpo, files=False))),
        plan.generation_batch_size,
        plan_spec.data.max_seq_len - 1,
        4,
    )
    fixed = _json(capsys, ["estimate", str(grpo), "--json", "rollout.generation_batch_size=3"])["generation"]
    assert fixed["generation_batch_size"] == 3 and not fixed["chosen_by_plan"]
    assert _json(capsys, ["estimate", str(_write(tmp_path, BASE)), "--json"])["generation"] is None
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["estimate", str(grpo)]) == 0
    out = capsys.readouterr().out
    assert "generation (transient)" in out
    assert f"generation: {plan.generation_batch_size} completions at once (the plan's choice" in out
