"""`rayft eval` of a preference spec: every number checked against an independent computation on
tiny-llama (ids written out from the byte tokenizer's definition and the chat template, one
sequence at a time, log_softmax by hand, greedy decoding by argmax), and the table through the CLI
in-process. The SFT path is tests/unit/data/test_chat.py's and tests/integration/test_cache.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runs import write_jsonl

from jobs.model.loading import byte_tokenizer, load_base_model
from jobs.run.outputs import claim_output_dir
from jobs.spec import load_spec
from orchestrator.cli import main

BOS, EOS = 257, 258
BETA = 0.25
STRING_PAIRS = [
    {"prompt": "upper: ray\n=> ", "chosen": "RAY", "rejected": "ray"},
    {"prompt": "first: lora tune\n=> ", "chosen": "lora", "rejected": "tune"},
    {"prompt": "sum: 2 3\n=> ", "chosen": "5", "rejected": "6"},
    {"prompt": "reverse: abc\n=> ", "chosen": "cba", "rejected": "abc"},
    {"prompt": "same\n=> ", "chosen": "x", "rejected": "x"},
]  # identical: dropped, counted
CHAT_PAIRS = [
    {
        "prompt": [{"role": "user", "content": f"Capital of {c}?"}],
        "chosen": [{"role": "assistant", "content": good}],
        "rejected": [{"role": "assistant", "content": bad}],
    }
    for c, good, bad in (("France", "Paris", "Lyon"), ("Canada", "Ottawa", "Toronto"), ("Turkey", "Ankara", "Istanbul"))
]


def B(s: str) -> list[int]:
    return list(s.encode())


def hand_ids(rec: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids by the rendering rules, written out: a string pair is BOS +
    prompt and response + EOS; a conversational one tiny-llama's template (BOS, `<|role|>\\n`
    content EOS per turn, generation prompt `<|assistant|>\\n`), the response its content + EOS."""
    if isinstance(rec["prompt"], str):
        return [BOS] + B(rec["prompt"]), B(rec["chosen"]) + [EOS], B(rec["rejected"]) + [EOS]
    prompt = [BOS] + B("<|user|>\n" + rec["prompt"][0]["content"]) + [EOS] + B("<|assistant|>\n")
    return prompt, B(rec["chosen"][0]["content"]) + [EOS], B(rec["rejected"][0]["content"]) + [EOS]


def response_logp(model, prompt: list[int], response: list[int]) -> float:
    """log p(response | prompt), one unpadded sequence, log_softmax by hand."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = logits - logits.exp().sum(-1, keepdim=True).log()
    return sum(logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response))


def greedy(model, prompt: list[int], n: int) -> str:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == EOS:
                break
            ids.append(nxt)
    return byte_tokenizer().decode(ids[len(prompt) :], skip_special_tokens=True)


def save_adapter(spec, directory: Path, seed: int) -> str:
    """A random LoRA adapter (A and B both non-zero) saved like a trained one."""
    from peft import LoraConfig, get_peft_model

    model, _ = load_base_model(spec, "fp32")
    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        target_modules=list(spec.lora.target_modules),
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.3)  # a policy near the base, as after training, so the margins are not huge
    peft_model.save_pretrained(directory)
    return str(directory)


def make_spec(tmp_path: Path, records: list[dict], objective: str = "dpo", start: bool = True, extra=None):
    data = tmp_path / "pairs.jsonl"
    write_jsonl(data, records)
    raw = {
        "name": "pref-eval",
        "model": {"name": "tiny-llama"},
        "objective": {"name": objective, "beta": BETA},
        "data": {"path": str(data), "eval_path": str(data), "max_seq_len": 64},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "run": {"output_dir": str(tmp_path / "out")},
        **(extra or {}),
    }
    spec = load_spec(data=raw)
    claim_output_dir(spec.output_path, name=spec.name)  # a run's directory, as `rayft run` leaves it
    save_adapter(spec, tmp_path / "out" / "adapter", seed=11)
    if start:
        raw["model"]["adapter"] = save_adapter(spec, tmp_path / "start", seed=7)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(raw))
    return load_spec(data=raw), spec_path


def independent(spec, adapter: str | None) -> list[tuple[float, float]]:
    """(logp chosen, logp rejected) of every kept pair under base (+ `adapter`), a fresh model."""
    from peft import PeftModel

    model, _ = load_base_model(spec, "fp32")
    if adapter:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    records = [json.loads(x) for x in Path(spec.data.eval_path).read_text().splitlines()]
    out = []
    for rec in records:
        p, c, r = hand_ids(rec)
        if c != r:
            out.append((response_logp(model, p, c), response_logp(model, p, r)))
    return out, model


def by_role(result: dict) -> dict:
    return {row["model"]: row for row in result["models"]}


@pytest.mark.parametrize("records", [STRING_PAIRS, CHAT_PAIRS], ids=["strings", "conversational"])
def test_preference_numbers_match_an_independent_computation(tmp_path, records):
    """Preference accuracy, mean margin and the DPO rewards of every model against per-pair,
    one-sequence-at-a-time log-probabilities; the rewards against the starting adapter."""
    from jobs.after.evaluate import evaluate

    spec, _ = make_spec(tmp_path, records)
    result = evaluate(spec, max_new_tokens=3)
    rows = by_role(result)
    assert list(rows) == ["base", "start", "adapter"]
    kept = [r for r in records if r["chosen"] != r["rejected"]]
    assert result["pairs"] == len(kept) and result["records"] == len(records)
    assert result["dropped"] == {"empty": 0, "identical": len(records) - len(kept)}
    want = {
        "base": independent(spec, None)[0],
        "start": independent(spec, spec.model.adapter)[0],
        "adapter": independent(spec, str(tmp_path / "out" / "adapter"))[0],
    }
    for role, logps in want.items():
        margins = [c - r for c, r in logps]
        assert rows[role]["mean_margin"] == pytest.approx(sum(margins) / len(margins), abs=2e-4)
        assert rows[role]["preference_accuracy"] == sum(m > 0 for m in margins) / len(margins)
        assert rows[role]["mean_logp_chosen"] == pytest.approx(sum(c for c, _ in logps) / len(logps), abs=2e-4)
    assert result["reference"] == "start"
    rewards = [
        (BETA * (pc - sc), BETA * (pr - sr)) for (pc, pr), (sc, sr) in zip(want["adapter"], want["start"], strict=True)
    ]
    trained = rows["adapter"]
    assert trained["rewards/margins"] == pytest.approx(sum(c - r for c, r in rewards) / len(rewards), abs=1e-4)
    assert trained["rewards/accuracies"] == sum(c > r for c, r in rewards) / len(rewards)
    assert trained["rewards/chosen"] == pytest.approx(sum(c for c, _ in rewards) / len(rewards), abs=1e-4)
    dpo = [-torch.nn.functional.logsigmoid(torch.tensor(c - r, dtype=torch.float64)).item() for c, r in rewards]
    assert trained["loss"] == pytest.approx(sum(dpo) / len(dpo), abs=1e-4)
    assert "rewards/margins" not in rows["base"] and "rewards/margins" not in rows["start"]
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["models"] == json.loads(json.dumps(result["models"]))
    assert saved["base_exact_match"] == rows["base"]["exact_match"]
    assert saved["adapter_exact_match"] == rows["adapter"]["exact_match"]


def test_without_a_starting_adapter_the_reference_is_the_base(tmp_path):
    from jobs.after.evaluate import evaluate

    spec, _ = make_spec(tmp_path, CHAT_PAIRS, objective="ipo", start=False)
    result = evaluate(spec, max_new_tokens=2)
    rows = by_role(result)
    assert list(rows) == ["base", "adapter"] and result["reference"] == "base"
    base, pi = independent(spec, None)[0], independent(spec, str(tmp_path / "out" / "adapter"))[0]
    h = [(pc - bc) - (pr - br) for (pc, pr), (bc, br) in zip(pi, base, strict=True)]
    assert rows["adapter"]["rewards/margins"] == pytest.approx(BETA * sum(h) / len(h), abs=1e-4)
    ipo = [(x - 1 / (2 * BETA)) ** 2 for x in h]
    assert rows["adapter"]["loss"] == pytest.approx(sum(ipo) / len(ipo), rel=1e-5, abs=1e-3)


def test_simpo_rewards_need_no_reference(tmp_path):
    from jobs.after.evaluate import evaluate

    spec, _ = make_spec(tmp_path, STRING_PAIRS[:4], objective="simpo", start=False)
    result = evaluate(spec, max_new_tokens=2)
    trained = by_role(result)["adapter"]
    assert result["reference"] is None
    pi = independent(spec, str(tmp_path / "out" / "adapter"))[0]
    lengths = [(len(hand_ids(r)[1]), len(hand_ids(r)[2])) for r in STRING_PAIRS[:4]]
    m = [BETA * (c / nc - r / nr) for (c, r), (nc, nr) in zip(pi, lengths, strict=True)]
    assert trained["rewards/margins"] == pytest.approx(sum(m) / len(m), abs=1e-5)


def test_exact_match_decodes_greedily_from_the_training_prompt(tmp_path, monkeypatch):
    """The prompts are the pairs' training prompt ids; predictions are greedy decoding (checked by
    an argmax loop, one sequence at a time); exact match compares with the chosen text."""
    import jobs.after.evaluate as ev

    spec, _ = make_spec(tmp_path, CHAT_PAIRS, start=False)
    seen = []
    real = ev.generate

    def spy(model, tok, prompts, max_new_tokens, batch_size=8):
        seen.append(prompts)
        return real(model, tok, prompts, max_new_tokens, batch_size)

    monkeypatch.setattr(ev, "generate", spy)
    result = ev.evaluate(spec, max_new_tokens=4)
    assert seen == [[hand_ids(r)[0] for r in CHAT_PAIRS]] * 2  # base, then the trained adapter
    _, trained = independent(spec, str(tmp_path / "out" / "adapter"))
    base, _ = load_base_model(spec, "fp32")
    for ex, rec in zip(result["examples"], CHAT_PAIRS, strict=True):
        assert ex["chosen"] == rec["chosen"][0]["content"] and ex["rejected"] == rec["rejected"][0]["content"]
        assert ex["base"] == greedy(base.eval(), hand_ids(rec)[0], 4)
        assert ex["adapter"] == greedy(trained, hand_ids(rec)[0], 4)

    # What is compared: the chosen message's content, stripped.
    monkeypatch.setattr(ev, "generate", lambda model, tok, prompts, n, batch_size=8: [" Paris\n", "Toronto", "Ankara"])
    rows = by_role(ev.evaluate(spec, max_new_tokens=4))
    assert rows["base"]["exact_match"] == rows["adapter"]["exact_match"] == pytest.approx(2 / 3)


def test_the_table_through_the_cli(tmp_path, capsys):
    _, spec_path = make_spec(tmp_path, STRING_PAIRS)
    assert main(["eval", str(spec_path), "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "rayft eval pref-eval: 4 held-out pairs (1 dropped), dpo beta 0.25" in err
    header = next(x for x in lines if "exact match" in x)
    for col in ("model", "exact match", "pref. accuracy", "mean margin", "rewards/accuracies", "rewards/margins"):
        assert col in header
    rows = [x for x in lines if x.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["base", "starting adapter", "trained adapter"]
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    cells = [[c.strip() for c in r.split("│")[2:-1]] for r in rows]
    for cell, row in zip(cells, result["models"], strict=True):
        assert cell[:3] == [
            f"{row['exact_match']:.1%}",
            f"{row['preference_accuracy']:.1%}",
            f"{row['mean_margin']:+.3f}",
        ]
    assert cells[0][3:] == cells[1][3:] == ["-", "-"]
    trained = result["models"][2]
    assert cells[2][3:] == [f"{trained['rewards/accuracies']:.1%}", f"{trained['rewards/margins']:+.4f}"]
    assert f"trained adapter: {tmp_path / 'out' / 'adapter'}" in err
    assert "rewards against the reference: starting adapter (beta 0.25)" in err


def test_a_preference_spec_without_held_out_pairs_is_one_line(tmp_path, capsys):
    spec_path = tmp_path / "s.json"
    data = tmp_path / "p.jsonl"
    write_jsonl(data, STRING_PAIRS)
    spec_path.write_text(
        json.dumps(
            {
                "name": "no-held-out",
                "model": {"name": "tiny-llama"},
                "objective": {"name": "dpo"},
                "data": {"path": str(data)},
                "run": {"output_dir": str(tmp_path / "o")},
            }
        )
    )
    assert main(["eval", str(spec_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "rayft: error: data.eval_path: rayft eval of objective.name=dpo needs a held-out file of preference pairs"
    )
    assert not (tmp_path / "o").exists()


def test_sft_records_in_a_preference_specs_eval_path_are_refused(tmp_path, capsys):
    spec, spec_path = make_spec(tmp_path, STRING_PAIRS, start=False)
    raw = json.loads(spec_path.read_text())
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    raw["data"]["eval_path"] = str(sft)
    spec_path.write_text(json.dumps(raw))
    assert main(["eval", str(spec_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayft: error: data.eval_path: ") and "objective.name=dpo trains on pairs" in err
    assert "\n" not in err


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["adapter_off", "precomputed"])
def test_the_trained_adapters_rewards_are_the_runs_last_evaluation(tmp_path, reference):
    """DPO from a starting adapter, two steps, evaluated at the last: `rayft eval`'s loss and
    rewards of the trained adapter against the starting adapter are the run's `eval_*`."""
    import contextlib
    import io

    from jobs.after.evaluate import evaluate
    from jobs.finetune import main as finetune_main

    root = Path(__file__).resolve().parents[3] / "examples" / "data"
    raw = {
        "name": "dpo-then-eval",
        "model": {"name": "tiny-llama"},
        "objective": {"name": "dpo", "beta": BETA, "reference": reference},
        "data": {
            "path": str(root / "tiny-pairs.jsonl"),
            "eval_path": str(root / "tiny-pairs-eval.jsonl"),
            "max_seq_len": 64,
        },
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 0.01},
        "resources": {"num_workers": 1},
        "run": {"max_steps": 2, "eval_every": 2, "checkpoint_every": 0, "output_dir": str(tmp_path / "out")},
    }
    raw["model"]["adapter"] = save_adapter(
        load_spec(data=raw | {"model": {"name": "tiny-llama"}}), tmp_path / "start", seed=7
    )
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(raw))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert finetune_main([str(spec_path), "--local"]) == 0
    last = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    result = evaluate(load_spec(str(spec_path)), max_new_tokens=1)
    trained = by_role(result)["adapter"]
    assert result["reference"] == "start" and result["pairs"] == 16
    assert trained["loss"] == pytest.approx(last["eval_loss"], abs=1e-5)
    for k in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    ):
        assert trained[k] == pytest.approx(last[f"eval_{k}"], abs=1e-5), k
