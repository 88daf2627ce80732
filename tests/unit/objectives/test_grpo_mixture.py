"""A mixture of prompt sources (`data.mix` with `objective.name: grpo`), as SFT's mixtures:

* each rollout batch's prompts are drawn by weight (`MixtureBatches` over prompts, P =
  global_batch_size / num_generations a batch): the per-source counts are the Sainte-Lague
  counts, each source's prompts come from its own file, read with its own `fields`, and its
  held-out prompts are its own `eval_path`'s or `data.eval_fraction` of its records;
* the run's steps do not depend on the split (1x1x16, 1x4x4 and 2 gloo ranks x 2 x 4 sample the
  same completions, log the same per-source metrics and losses) and a resume is bitwise;
* a source that never gets a prompt, a source with none short enough, and text mixed with
  conversations across sources are each one line, exit 2, before the run directory exists;
* the held-out reward is the whole's (`eval_reward`) and each source's (`eval_reward/NAME`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from gradtools import ROOT, final_adapter, reference_run, spawn
from grpo_rollouts import SMALL as GRPO_SMALL
from grpo_rollouts import assert_same_rollouts
from runs import metric_lines, write_jsonl

from jobs.data.mixture import MixtureBatches
from jobs.errors import SpecError
from jobs.model.loading import load_tokenizer
from jobs.objectives import Objective
from jobs.spec import load_spec

DEMO = ROOT / "examples" / "tiny-grpo.yaml"
# tiny.jsonl's records whose prompt fits data.max_seq_len 96 - max_completion_length 12 (185 of 256)
TINY = [r for r in map(json.loads, (ROOT / "examples" / "data" / "tiny.jsonl").read_text().splitlines())]
TINY = [r for r in TINY if len(r["prompt"]) <= 80]
SMALL = [
    *GRPO_SMALL,
    "data.eval_fraction=0.1",
]


def _sources(tmp: Path, weights=(3, 1)) -> list[dict]:
    """Two prompt sources of tiny.jsonl's records: `alpha` (100 records, `data.eval_fraction` held
    out) and `beta` (60 records whose prompt column is `question`, its own 10 held-out records)."""
    alpha = write_jsonl(tmp / "alpha.jsonl", TINY[:100])
    beta = write_jsonl(tmp / "beta.jsonl", [{"question": r["prompt"], "ans": r["completion"]} for r in TINY[100:160]])
    held = write_jsonl(tmp / "beta-held.jsonl", [{"question": r["prompt"]} for r in TINY[160:170]])
    return [
        {"path": str(alpha), "weight": weights[0]},
        {"path": str(beta), "weight": weights[1], "fields": {"prompt": "question"}, "eval_path": str(held)},
    ]


def write_spec(tmp: Path, sources: list[dict]) -> Path:
    """tiny-grpo.yaml with `data.mix` = `sources` instead of its one `data.path`."""
    doc = yaml.safe_load(DEMO.read_text())
    doc["data"] = {"mix": sources, "max_seq_len": 96}
    path = tmp / "mix-grpo.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def mix_spec(tmp: Path, *more: str, sources: list[dict] | None = None):
    path = write_spec(tmp, _sources(tmp) if sources is None else sources)
    return load_spec(path, [*SMALL, *more, f"run.output_dir={tmp / 'out'}"], files=False)


def test_each_source_is_read_with_its_own_fields_and_held_out_prompts(tmp_path):
    spec = mix_spec(tmp_path)
    tok = load_tokenizer(spec)
    data, _, _ = Objective.of(spec).load_data(spec, tok)
    alpha, beta = data.sources
    assert (alpha.name, alpha.weight, beta.name, beta.weight) == ("alpha", 3, "beta", 1)
    # alpha holds 10% of its 100 records out (data.eval_fraction); beta has its own held-out file
    assert (alpha.train_offset, alpha.n_train, alpha.n_eval) == (0, 90, 10)
    assert (beta.train_offset, beta.n_train, beta.n_eval) == (90, 60, 10)
    assert len(data.train) == 150 and len(data.eval) == 20
    assert all(w.startswith("data.mix.0.path: ") for w in data.train.where[:90])
    assert all(w.startswith("data.mix.1.path: ") for w in data.train.where[90:])
    assert all(w.startswith("data.mix.1.eval_path: ") for w in data.eval.where[10:])
    # beta's `question` column became the prompt (its fields), its other column goes to the rewards
    assert data.train.prompts[90:] == [r["prompt"] for r in TINY[100:160]]
    assert data.train.columns[90] == {"ans": TINY[100]["completion"]}
    assert data.eval.prompts[10:] == [r["prompt"] for r in TINY[160:170]]


def test_each_rollout_batch_draws_its_prompts_by_weight_from_the_sources(tmp_path):
    """40 rollout batches of 4 prompts from sources weighted 3:1: each batch's per-source counts are
    the Sainte-Lague counts of the prompt slots (so 120:40 over the run), each index within its
    source's range, and with num_iterations 2 steps 2b and 2b+1 share batch b's prompts."""
    spec = mix_spec(tmp_path, "objective.num_iterations=2")
    tok = load_tokenizer(spec)
    data, batches, _ = Objective.of(spec).load_data(spec, tok)
    ref = MixtureBatches([90, 60], [3, 1], 4, spec.run.seed)
    got = [0, 0]
    for b in range(40):
        idx = batches.index_array(2 * b)
        assert np.array_equal(idx, batches.index_array(2 * b + 1)) and np.array_equal(idx, ref.index_array(b))
        for s, part in enumerate(data.sources):
            got[s] += int(((idx >= part.train_offset) & (idx < part.train_offset + part.n_train)).sum())
    assert got == ref.counts(160) == [120, 40]


def test_every_split_trains_the_same_steps_and_per_source_metrics(tmp_path, monkeypatch):
    """1x1x16, 1x4x4 and 2 gloo ranks x 2 x 4, 3 steps: the same completions each step (the same
    prompts from the same sources), the same `samples/NAME`, `reward/NAME`, `epoch/NAME` and losses
    (fp32: 1e-5), the per-source samples adding up to the batch and their rewards to its mean."""
    monkeypatch.chdir(ROOT)
    spec_path = write_spec(tmp_path, _sources(tmp_path, weights=(1, 1)))
    runs = {}
    for w, m in ((1, 16), (1, 4), (2, 4)):
        out = tmp_path / f"W{w}m{m}"
        overrides = [*SMALL, f"resources.num_workers={w}", f"batch.micro_batch_size={m}", "run.max_steps=3"]
        overrides += ["run.checkpoint_every=0", "optim.lr=0.05"]
        if w == 1:
            reference_run(0, 1, str(spec_path), overrides, str(out))
        else:
            spawn(reference_run, w, tmp_path / "spawn", str(spec_path), overrides, str(out))
        steps = [(out / "rollouts" / f"step-{k:06d}.jsonl").read_text() for k in range(1, 4)]
        runs[(w, m)] = (metric_lines(out), steps)
    (want_metrics, want_steps), *others = runs.values()
    per_source = [k for k in want_metrics[0] if k.split("/")[0] in ("samples", "reward", "epoch")]
    assert {"samples/alpha", "samples/beta", "epoch/alpha", "epoch/beta"} <= set(per_source)
    for r in want_metrics:
        counts = {n: r.get(f"samples/{n}", 0) for n in ("alpha", "beta")}
        assert sum(counts.values()) == 16
        mean = sum(r[f"reward/{n}"] * c for n, c in counts.items() if c) / 16
        assert mean == pytest.approx(r["reward"], rel=1e-9)
    for metrics, steps in others:
        for got_step, want_step in zip(steps, want_steps, strict=True):
            assert_same_rollouts(got_step, want_step)
        for a, b in zip(metrics, want_metrics, strict=True):
            assert {k: a[k] for k in per_source} == pytest.approx({k: b[k] for k in per_source}, rel=1e-12)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)


def _train_steps(spec_path: Path, out: Path, steps: int) -> None:
    overrides = [*SMALL, "batch.micro_batch_size=8", "run.checkpoint_every=2", f"run.max_steps={steps}"]
    overrides += ["optim.schedule=constant", "optim.lr=0.05", "run.eval_every=2"]  # both evaluate at 2 and 4
    from jobs.spec import absolutize
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    spec = absolutize(load_spec(spec_path, [*overrides, f"run.output_dir={out}"]))
    train(spec, LocalContext(on_progress=lambda r: None), resume=True)


def test_a_mixture_run_resumes_bitwise(tmp_path, monkeypatch):
    """4 steps straight = 2, then resumed to 4: the same adapter bit for bit, the same metrics
    (per-source and held-out ones included), the same completions after the checkpoint."""
    monkeypatch.chdir(ROOT)
    spec_path = write_spec(tmp_path, _sources(tmp_path))
    _train_steps(spec_path, tmp_path / "straight", 4)
    _train_steps(spec_path, tmp_path / "resumed", 2)
    _train_steps(spec_path, tmp_path / "resumed", 4)
    a, b = final_adapter(tmp_path / "straight"), final_adapter(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    drop = ("tokens_per_s", "step_time_s", "peak_mem_gib", "time/")
    straight, resumed = metric_lines(tmp_path / "straight"), metric_lines(tmp_path / "resumed")
    assert [{k: v for k, v in r.items() if not k.startswith(drop)} for r in straight] == [
        {k: v for k, v in r.items() if not k.startswith(drop)} for r in resumed
    ]
    assert straight[-1]["epoch/alpha"] > 0 and straight[-1]["epoch/beta"] > 0
    # held out: 10 prompts of each source; the whole's reward is their count-weighted mean
    last = straight[-1]
    assert last["eval_reward"] == pytest.approx((10 * last["eval_reward/alpha"] + 10 * last["eval_reward/beta"]) / 20)
    for k in range(3, 5):  # the resumed run sampled the same completions after the checkpoint
        name = f"rollouts/step-{k:06d}.jsonl"
        assert_same_rollouts((tmp_path / "resumed" / name).read_text(), (tmp_path / "straight" / name).read_text())


def _refused(tmp_path: Path, capsys, sources: list[dict], *more: str) -> str:
    from jobs.finetune import main

    out = tmp_path / "out"
    spec_path = write_spec(tmp_path, sources)
    assert main([str(spec_path), "--local", *SMALL, *more, f"run.output_dir={out}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not out.exists()  # refused before the run directory is made
    assert lines[0].startswith("error: ")
    return lines[0].removeprefix("error: ")


def test_a_source_whose_weight_gets_it_no_prompt_is_refused(tmp_path, capsys):
    line = _refused(tmp_path, capsys, _sources(tmp_path, weights=(1000, 1)), "run.max_steps=2")
    assert "data.mix: source 'beta' (weight 1) gets no sample" in line


def test_a_source_with_no_prompt_short_enough_is_refused(tmp_path, capsys):
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 200}] * 5)
    line = _refused(tmp_path, capsys, [*_sources(tmp_path), {"path": str(long), "weight": 1}])
    assert line.startswith("data.mix.2: source 'long'")
    assert "no usable training prompts (4 longer than" in line  # the fifth is held out


def test_text_and_conversation_prompts_across_sources_are_refused(tmp_path, capsys):
    chat = ROOT / "examples" / "data" / "capitals-prompts-train.jsonl"
    line = _refused(tmp_path, capsys, [*_sources(tmp_path), {"path": str(chat), "weight": 1}])
    assert (
        line.startswith("data.mix.2.path: ") and "is a conversation, unlike the first record (data.mix.0.path" in line
    )


def test_the_preview_shows_each_source(tmp_path):
    spec = mix_spec(tmp_path)
    tok = load_tokenizer(spec)
    doc = Objective.of(spec).preview(spec, tok, 200)
    data, _, _ = Objective.of(spec).load_data(spec, tok)
    assert [s["name"] for s in doc["sources"]] == ["alpha", "beta"]
    assert [(s["train"]["kept"], s["eval"]["kept"]) for s in doc["sources"]] == [(90, 10), (60, 10)]
    assert [[t["id"] for t in s["tokens"]] for s in doc["samples"]] == data.train.ids
    assert [s["source"] for s in doc["samples"]] == ["alpha"] * 90 + ["beta"] * 60


def test_load_data_refuses_what_the_spec_cannot(tmp_path):
    """The refusal is the data's: a spec check of the same mixture passes (no files read)."""
    spec = mix_spec(tmp_path, sources=_sources(tmp_path, weights=(1000, 1)))
    with pytest.raises(SpecError, match="gets no sample"):
        Objective.of(spec).load_data(spec, load_tokenizer(spec))
