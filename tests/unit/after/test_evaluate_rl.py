"""Held-out reward of a GRPO spec: the run evaluates greedy answers to its held-out prompts every
`run.eval_every` steps (`eval_reward`, `eval_rewards/<name>/mean` in metrics.jsonl and
summary.json), and `rayft eval` scores the base and the trained adapter the same way -- the trained
adapter's reward is the run's last `eval_reward`, to the bit (the same greedy ids, the same
functions)."""

from __future__ import annotations

import json

from gradtools import ROOT

from jobs.rollout import held_out
from jobs.spec import load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

SPEC = ROOT / "examples" / "tiny-grpo.yaml"
REWARD = ROOT / "tests" / "helpers" / "rewards_tiny.py"
RUN = [
    "resources.num_workers=1",
    "rollout.max_completion_length=12",
    "data.max_seq_len=96",
    "lora.r=4",
    "lora.alpha=8",
    "batch.global_batch_size=16",
    "rollout.num_generations=4",
    "run.max_steps=2",
    "run.eval_every=1",
    "data.eval_fraction=0.05",
    f"reward.functions=[{{fn: '{REWARD}:ids_mod_5'}}, {{name: regex, pattern: '[a-z ]*'}}]",
    "optim.lr=0.05",
]


def test_the_run_and_rayft_eval_score_the_held_out_prompts_alike(tmp_path, capsys):
    from orchestrator.cli import main

    overrides = [*RUN, f"run.output_dir={tmp_path / 'run'}"]
    summary = train(load_spec(SPEC, overrides), LocalContext(on_progress=lambda r: None), resume=False)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("eval_reward" in m and "eval_rewards/ids_mod_5/mean" in m for m in metrics)
    assert summary["eval_reward"] == metrics[-1]["eval_reward"]
    code = main(["eval", str(SPEC), *overrides])
    out = capsys.readouterr().err
    assert code == 0 and "held-out prompts" in out and "trained adapter" in out
    assert "Writing model shards" not in out  # transformers' progress bar on saving tiny-llama's base
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    base, adapter = result["models"]
    assert (base["model"], adapter["model"]) == ("base", "adapter")
    assert adapter["reward"] == metrics[-1]["eval_reward"]
    assert adapter["rewards/regex/mean"] == metrics[-1]["eval_rewards/regex/mean"]
    held = round(0.05 * 256)  # data.eval_fraction of the 256 records; the longest prompts dropped, counted
    assert result["prompts"] + result["dropped"] == held and result["prompts"] > 0
    assert "exact_match" not in adapter  # no exact_match function


def test_rayft_eval_generates_in_the_batches_the_run_generated_in(tmp_path, monkeypatch, capsys):
    """Greedy answers depend, in the last bits of the logits, on which rows are left-padded together:
    rayft eval replays the run's held-out batches (each rank's share in micro-batches), not batches
    of its own size, so the trained adapter's answers are the run's."""
    from orchestrator.cli import main

    calls: list[list[int]] = []
    real = held_out.greedy

    def spy(engine, prompts, indices, max_completion_length):
        calls.append(list(indices))
        return real(engine, prompts, indices, max_completion_length)

    monkeypatch.setattr(held_out, "greedy", spy)
    overrides = [*RUN, "batch.micro_batch_size=4", "run.max_steps=1", f"run.output_dir={tmp_path / 'run'}"]
    train(load_spec(SPEC, overrides), LocalContext(on_progress=lambda r: None), resume=False)
    run_batches, calls[:] = list(calls), []
    assert len(run_batches) > 1 and max(map(len, run_batches)) == 4  # the held-out prompts span batches
    assert main(["eval", str(SPEC), *overrides]) == 0
    capsys.readouterr()
    assert calls == run_batches * 2  # the base, then the trained adapter, each in the run's batches
