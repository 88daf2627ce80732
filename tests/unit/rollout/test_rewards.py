"""Reward functions (`jobs.rollout.rewards`): the built-ins by their stated rules, a user function from a
file beside the spec or from a module, called with TRL's keywords and the records' other columns,
weighted with TRL's nansum; and every way a function can fail is one line naming the function and
the record (exit 2), a slow one exit 1, a missing file, name or column exit 2."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from jobs.errors import RewardError, RewardTimeout, SpecError
from jobs.rollout.rewards import Batch, check_columns, resolve, score
from jobs.spec import load_spec

DEMO = Path(__file__).resolve().parents[3] / "examples" / "tiny-grpo.yaml"


def functions(tmp_path: Path, listed: str, source: str = ""):
    """The resolved functions of a spec beside `rewards.py` (holding `source`) in `tmp_path`."""
    (tmp_path / "rewards.py").write_text(source)
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(DEMO.read_text())
    spec = load_spec(spec_file, [f"reward.functions={listed}"], files=False)
    return resolve(spec.reward), spec.reward.timeout_s


def batch(completions: list, answers: list | None = None) -> Batch:
    n = len(completions)
    columns = {"answer": answers if answers is not None else ["Paris"] * n, "level": list(range(n))}
    return Batch([f"Capital {i}?" for i in range(n)], completions, [[1, 2]] * n, [10 + i for i in range(n)], columns)


def test_exact_match_strips_joins_whitespace_and_folds_case_unless_told(tmp_path):
    fs, t = functions(
        tmp_path, "[{name: exact_match, column: answer}, {name: exact_match, column: answer, case_sensitive: true}]"
    )
    got = [
        "  paris ",
        "Paris\n",
        "PARIS",
        "Par is",
        "Paris.",
        "New   York",
        [{"role": "assistant", "content": " Paris"}],
    ]
    answers = ["Paris"] * 5 + ["new york", "Paris"]
    values, _ = score(fs, batch(got, answers), t)
    assert [v[0] for v in values] == [1, 1, 1, 0, 0, 1, 1]
    assert [v[1] for v in values] == [0, 1, 0, 0, 0, 0, 1]


def test_exact_match_is_not_applicable_where_the_answer_is_null(tmp_path):
    fs, t = functions(tmp_path, "[{name: exact_match, column: answer}]")
    values, reward = score(fs, batch(["Paris", "Rome"], ["Paris", None]), t)
    assert values[0] == [1.0] and math.isnan(values[1][0]) and math.isnan(reward[1])


def test_regex_matches_the_whole_completion_across_lines(tmp_path):
    fs, t = functions(tmp_path, r"[{name: regex, pattern: '<think>.*</think>\s*\w+'}]")
    values, _ = score(fs, batch(["<think>a\nb</think> Paris", "Paris <think></think> x", "<think></think>"]), t)
    assert [v[0] for v in values] == [1.0, 0.0, 0.0]


def test_a_user_function_gets_trls_keywords_and_the_other_columns_weights_sum_with_nansum(tmp_path):
    source = (
        "def score(prompts, completions, completion_ids, answer, level, **kw):\n"
        "    assert len(prompts) == len(completions) == len(completion_ids) == len(answer) == len(level)\n"
        "    return [None if lv == 1 else float(lv) for lv in level]\n"
    )
    fs, t = functions(
        tmp_path, "[{fn: rewards.py:score, weight: 0.5}, {name: exact_match, column: answer, weight: 2}]", source
    )
    assert [f.label for f in fs] == ["score", "exact_match"]
    values, reward = score(fs, batch(["Paris", "Rome", "x"]), t)
    assert values[0] == [0.0, 1.0] and math.isnan(values[1][0]) and values[2] == [2.0, 0.0]
    assert reward == [2.0, 0.0, 1.0]  # row 1: only exact_match applies (0 x 2)


def test_a_module_function_is_imported(tmp_path, monkeypatch):
    (tmp_path / "myrewards").mkdir()
    (tmp_path / "myrewards" / "__init__.py").write_text("")
    (tmp_path / "myrewards" / "fmt.py").write_text(
        "def short(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fs, t = functions(tmp_path, "[{fn: myrewards.fmt:short}]")
    assert score(fs, batch(["a", "b"]), t)[1] == [1.0, 1.0]
    sys.modules.pop("myrewards.fmt", None)
    sys.modules.pop("myrewards", None)


@pytest.mark.parametrize(
    ("listed", "source", "says"),
    [
        ("[{fn: nope.py:score}]", "", "reward.functions.0.fn: file not found: "),
        (
            "[{fn: rewards.py:scor}]",
            "def score(**kw): pass\ndef other(**kw): pass\n",
            "rewards.py has no function 'scor' (its functions: other, score)",
        ),
        ("[{fn: rewards.py:X}]", "X = 3\n", "rewards.py is not a function 'X'"),
        ("[{fn: rewards.py:score}]", "import not_a_module_here\n", "importing "),
        ("[{fn: not_a_module_here.sub:score}]", "", "no module named 'not_a_module_here'"),
    ],
)
def test_a_missing_file_name_or_module_is_one_line(tmp_path, listed, source, says):
    with pytest.raises(SpecError) as e:
        functions(tmp_path, listed, source)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_column_missing_from_the_data_is_one_line(tmp_path):
    fs, _ = functions(tmp_path, "[{name: exact_match, column: solution}]")
    with pytest.raises(
        SpecError,
        match=r"reward.functions.0 \(exact_match on solution\): the data has no column 'solution' "
        r"\(it has: 'prompt', 'answer'\)",
    ):
        check_columns(fs, ["prompt", "answer"])
    check_columns(fs, ["prompt", "solution"])


BAD = {
    "raises": (
        "def score(completions, **kw):\n    if any('boom' in c for c in completions): raise ValueError('no')\n"
        "    return [1.0] * len(completions)\n",
        "raised ValueError: no for record 11 (prompt 'Capital 1?')",
    ),
    "count": ("def score(completions, **kw):\n    return [1.0]\n", "returned 1 values for 3 completions"),
    "nan": (
        "def score(completions, **kw):\n    return [1.0, float('nan'), 0.0]\n",
        "returned nan for record 11 (prompt 'Capital 1?')",
    ),
    "inf": ("def score(completions, **kw):\n    return [1.0, 0.0, -float('inf')]\n", "returned -inf for record 12"),
    "text": (
        "def score(completions, **kw):\n    return [1.0, '1', 0.0]\n",
        "returned '1' (str, not a number) for record 11",
    ),
    "scalar": ("def score(completions, **kw):\n    return 1.0\n", "returned float, not a list of numbers"),
}


@pytest.mark.parametrize("how", sorted(BAD))
def test_a_function_that_fails_is_one_line_naming_it_and_the_record(tmp_path, how):
    source, says = BAD[how]
    fs, t = functions(tmp_path, "[{fn: rewards.py:score}]", source)
    with pytest.raises(RewardError) as e:
        score(fs, batch(["ok", "boom", "ok"]), t)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert f"reward.functions.0 ({tmp_path / 'rewards.py'}:score) " in str(e.value) and says in str(e.value)


def test_numpy_scalars_and_booleans_are_numbers(tmp_path):
    source = "import numpy as np\ndef score(completions, **kw):\n    return [np.float32(0.5), True, np.int64(2)]\n"
    fs, t = functions(tmp_path, "[{fn: rewards.py:score}]", source)
    assert score(fs, batch(["a", "b", "c"]), t)[1] == [0.5, 1.0, 2.0]


def test_a_function_slower_than_the_timeout_is_exit_1(tmp_path):
    source = "import time\ndef score(completions, **kw):\n    time.sleep(5)\n    return [1.0] * len(completions)\n"
    fs, _ = functions(tmp_path, "[{fn: rewards.py:score}]", source)
    with pytest.raises(RewardTimeout, match=r"ran longer than reward.timeout_s=0.2 s on 2 completions") as e:
        score(fs, batch(["a", "b"]), 0.2)
    assert e.value.exit_code == 1


def test_completions_reach_a_function_as_trl_builds_them():
    from jobs.model.loading import byte_tokenizer
    from jobs.rollout.rewards import completions_as_trl

    tok = byte_tokenizer()
    ids = [list(b"Paris") + [tok.eos_token_id], list(b"Ro")]
    assert completions_as_trl(tok, ids, conversational=False) == ["Paris", "Ro"]
    assert completions_as_trl(tok, ids, conversational=True)[0] == [{"role": "assistant", "content": "Paris"}]
