"""What a step's rollouts leave (`jobs.rollout.record`): TRL's metric names and definitions over the
whole global batch, and `rollouts/step-NNNNNN.jsonl` with one line per completion holding exactly
the trained ids; unscored values are null."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from jobs.rollout.record import rollout_lines, rollout_metrics, step_file, write_rollouts

NAN = math.nan
LABELS = ["exact_match", "score"]
VALUES = [[1.0, 0.5], [0.0, NAN], [1.0, 1.0], [1.0, 0.0], [NAN, NAN], [0.0, 0.2]]
REWARDS = [1.5, 0.0, 2.0, 1.0, NAN, 0.2]  # weights 1 and 1; row 4 unscored
IDS = [[5, 6, 2], [7], [8, 9, 10, 11], [12, 2], [13, 14, 15, 16], [17, 2]]
TRUNCATED = [False, True, True, False, True, False]


def test_metrics_have_trls_names_and_values():
    m = rollout_metrics(VALUES, REWARDS, LABELS, 2, IDS, TRUNCATED)
    scored = [r for r in REWARDS if not math.isnan(r)]
    assert m["reward"] == pytest.approx(statistics.fmean(scored))
    assert m["reward_std"] == pytest.approx(statistics.stdev(scored))
    assert m["rewards/exact_match/mean"] == pytest.approx(0.6) and m["rewards/score/mean"] == pytest.approx(1.7 / 4)
    assert m["rewards/exact_match/std"] == pytest.approx(statistics.stdev([1, 0, 1, 1, 0]))
    # groups (1.5, 0) (2, 1) (nan, 0.2): the last has one scored completion, no signal
    assert m["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert m["completions/mean_length"] == pytest.approx(16 / 6)
    assert (m["completions/min_length"], m["completions/max_length"]) == (1.0, 4.0)
    assert m["completions/clipped_ratio"] == pytest.approx(0.5)
    assert m["completions/mean_terminated_length"] == pytest.approx(7 / 3)
    assert (m["completions/min_terminated_length"], m["completions/max_terminated_length"]) == (2.0, 3.0)


def test_a_group_whose_rewards_agree_has_zero_std():
    m = rollout_metrics([[1.0], [1.0], [0.0], [1.0]], [1.0, 1.0, 0.0, 1.0], ["r"], 2, [[1]] * 4, [False] * 4)
    assert m["frac_reward_zero_std"] == 0.5


def test_the_rollouts_file_holds_one_line_per_completion_with_the_trained_ids(tmp_path):
    lines = rollout_lines(
        [3, 3, 8, 8, 9, 9],
        ["Capital of France?"] * 2 + ["Capital of Italy?"] * 2 + ["x"] * 2,
        [[257, 1, 2]] * 6,
        ["Paris", "Lyon", "Rome", "Rome.", "a", "b"],
        IDS,
        TRUNCATED,
        VALUES,
        LABELS,
        REWARDS,
        [0.7, -0.7, 0.7, -0.7, 0.0, 0.0],
    )
    path = write_rollouts(tmp_path, 12, lines)
    assert path == step_file(tmp_path, 12) == tmp_path / "rollouts" / "step-000012.jsonl"
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(got) == 6 and got[0] == {
        "prompt_index": 3,
        "prompt": "Capital of France?",
        "prompt_ids": [257, 1, 2],
        "completion": "Paris",
        "completion_ids": [5, 6, 2],
        "truncated": False,
        "rewards": {"exact_match": 1.0, "score": 0.5},
        "reward": 1.5,
        "advantage": 0.7,
    }
    assert got[4]["rewards"] == {"exact_match": None, "score": None} and got[4]["reward"] is None
    assert [g["completion_ids"] for g in got] == IDS
    assert not list((tmp_path / "rollouts").glob("*.tmp"))


def test_the_engine_logprob_gap_is_a_mean_over_tokens_not_over_completions():
    from jobs.rollout.record import logprob_fields, logprob_gap_metrics

    trainer = [[-1.0, -2.0, -3.0, -4.0], [-0.5]]
    engine = [[-1.1, -2.1, -3.1, -4.1], [-1.5]]  # gaps 0.1 x 4 and 1.0 x 1
    got = logprob_gap_metrics(trainer, engine)
    assert got["engine_logprob_gap/mean"] == pytest.approx(1.4 / 5)  # a mean of the two means is 0.55
    assert got["engine_logprob_gap/max"] == pytest.approx(1.0)
    line = logprob_fields(trainer[0], engine[0])
    assert line["trainer_logprobs"] == trainer[0] and line["engine_logprobs"] == engine[0]
    assert line["engine_logprob_gap"] == {"mean": pytest.approx(0.1), "max": pytest.approx(0.1)}
    assert logprob_fields([], [])["engine_logprob_gap"] == {"mean": None, "max": None}
    assert math.isnan(logprob_gap_metrics([[]], [[]])["engine_logprob_gap/max"])
