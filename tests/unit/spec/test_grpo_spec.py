"""The GRPO spec (`objective.name: grpo`, the `rollout` and `reward` sections): TRL's names and
defaults, documented in `rayft spec schema`; every impossible combination refused in one line
naming the fields; specs of the other objectives read and hash as before; the commands that do not
take a GRPO spec (data prepare) refuse it in one line before anything is created."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs.errors import SpecError
from jobs.spec import json_schema, load_spec

DEMO = "examples/tiny-lora.yaml"
GRPO = [
    "objective.name=grpo",
    "reward.functions=[{name: exact_match, column: answer}]",
    "rollout.num_generations=4",
    "data.eval_path=null",  # no held-out split: its evaluation generates (time these tests do not need)
]


def grpo(*more: str, files: bool = False):
    return load_spec(DEMO, [*GRPO, *more], files=files)


def test_the_schema_shows_every_new_key_with_its_documentation():
    schema = json_schema()
    defs = schema["$defs"]
    assert {"rollout", "reward"} <= set(schema["properties"])
    want = {
        "RolloutSpec": {
            "engine",
            "vllm_url",
            "vllm_timeout_s",
            "vllm_start_timeout_s",
            "vllm_kv_cache_gib",
            "vllm_placement",
            "vllm_num_gpus",
            "vllm_num_cpus",
            "vllm_sleep",
            "num_generations",
            "max_completion_length",
            "temperature",
            "top_p",
            "top_k",
            "generation_batch_size",
            "importance_correction",
            "importance_correction_cap",
        },
        "RewardSpec": {"functions", "timeout_s"},
        "RewardFunctionSpec": {"name", "fn", "column", "case_sensitive", "pattern", "weight"},
    }
    for cls, keys in want.items():
        assert set(defs[cls]["properties"]) == keys, cls
        assert all(p.get("description") for p in defs[cls]["properties"].values()), cls


def test_trl_defaults_and_the_resolved_upper_clip():
    spec = grpo()
    assert spec.rollout.model_dump() == {
        "engine": "hf",
        "vllm_url": None,
        "vllm_timeout_s": 300.0,
        "vllm_start_timeout_s": 600.0,
        "vllm_kv_cache_gib": None,
        "vllm_placement": "colocate",
        "vllm_num_gpus": None,
        "vllm_num_cpus": 1.0,
        "vllm_sleep": False,
        "num_generations": 4,
        "max_completion_length": 128,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "generation_batch_size": None,
        "importance_correction": False,
        "importance_correction_cap": 3.0,
    }
    assert spec.objective.clip_high == 0.2 and grpo("objective.epsilon_high=0.28").objective.clip_high == 0.28
    assert spec.reward.timeout_s == 60 and spec.reward.functions[0].weight == 1.0


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("rollout.num_generations=1", "rollout.num_generations: must be at least 2 (got 1)"),
        ("rollout.num_generations=5", "batch.global_batch_size=32 is not a multiple of rollout.num_generations=5"),
        ("rollout.temperature=0", "rollout.temperature=0 samples greedily"),
        ("rollout.max_completion_length=256", "leaves no room for a prompt in data.max_seq_len=256"),
        ("rollout.engine=sglang", "rollout.engine: Input should be 'hf' or 'vllm'"),
        ("rollout.engine=vllm", "rollout.engine=vllm serves a saved model: the built-in tiny-llama is none"),
        ("rollout.vllm_url=http://127.0.0.1:8000", "rollout.vllm_url applies to rollout.engine=vllm"),
        ("rollout.vllm_url=localhost:8000", "rollout.vllm_url: 'localhost:8000' is not an http(s)://HOST:PORT URL"),
        ("rollout.vllm_timeout_s=0", "rollout.vllm_timeout_s: Input should be greater than 0"),
        ("rollout.importance_correction=true", "rollout.importance_correction applies to rollout.engine=vllm"),
        ("rollout.importance_correction_cap=0.5", "rollout.importance_correction_cap: Input should be greater than"),
        ("rollout.top_p=0", "rollout.top_p: Input should be greater than 0"),
        ("data.packing=true", "data.packing is not available with objective.name=grpo"),
        ("objective.loss_type=bnpo", "objective.loss_type: Input should be 'dapo', 'grpo' or 'dr_grpo'"),
        ("objective.scale_rewards=std", "objective.scale_rewards: Input should be 'group', 'batch' or 'none'"),
        ("objective.epsilon=1", "objective.epsilon: Input should be less than 1"),
        ("objective.beta=-1", "objective.beta: Input should be greater than or equal to 0"),
        ("objective.reference=precomputed", "objective: reference does not apply to objective.name=grpo"),
        ("reward.functions=[]", "reward.functions: List should have at least 1 item"),
        ("reward.functions=[{name: exact_match}]", "reward.functions.0: exact_match needs `column`"),
        ("reward.functions=[{name: regex}]", "reward.functions.0: regex needs `pattern`"),
        ("reward.functions=[{name: regex, pattern: '('}]", "reward.functions.0: pattern: not a regular expression"),
        ("reward.functions=[{name: regex, pattern: a, column: x}]", "`column` does not apply to regex"),
        ("reward.functions=[{fn: 'a b:c'}]", "reward.functions.0: fn: 'a b' is neither a .py file nor a dotted"),
        ("reward.functions=[{fn: rewards.py}]", "reward.functions.0: fn: 'rewards.py' is not FILE.py:NAME"),
        ("reward.functions=[{name: regex, pattern: a, fn: m:f}]", "give a built-in `name` (exact_match or regex) or"),
        ("reward.functions=[{name: bleu}]", "reward.functions.0.name: Input should be 'exact_match' or 'regex'"),
        ("reward.timeout_s=0", "reward.timeout_s: Input should be greater than 0"),
    ],
)
def test_a_spec_that_cannot_run_is_refused_in_one_line_naming_the_field(override, says):
    with pytest.raises(SpecError) as e:
        grpo(override)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_grpo_needs_a_reward_and_the_other_objectives_take_no_rollout_or_reward():
    with pytest.raises(SpecError, match="objective.name=grpo needs at least one reward function"):
        load_spec(DEMO, ["objective.name=grpo"], files=False)
    for section in ("rollout.num_generations=4", "reward.functions=[{name: regex, pattern: a}]"):
        with pytest.raises(SpecError, match=f"{section.split('.')[0]} applies to objective.name=grpo only"):
            load_spec(DEMO, ["objective.name=dpo", section], files=False)
    with pytest.raises(SpecError, match="loss_type does not apply to objective.name=sft"):
        load_spec(DEMO, ["objective.loss_type=grpo"], files=False)


def test_another_objectives_spec_reads_and_hashes_as_before_the_sections_existed():
    spec = load_spec(DEMO, files=False)
    assert "rollout" not in spec.to_dict() and "reward" not in spec.to_dict()
    assert spec.spec_hash() == "5ec01d9d52"  # the demo's hash on main before GRPO (commit b1a6cad)
    assert {"rollout", "reward"} <= set(grpo().to_dict())


def test_reward_metric_names_are_the_functions_names_made_unique():
    spec = grpo(
        "reward.functions=[{name: regex, pattern: a}, {fn: pkg.mod:score}, {name: regex, pattern: b}, "
        "{name: exact_match, column: answer, weight: 0.5}]"
    )
    assert spec.reward.labels == ["regex", "score", "regex_2", "exact_match"]


def test_a_user_reward_file_is_found_beside_the_spec_file_whatever_the_current_directory(tmp_path, monkeypatch):
    from jobs.spec import absolutize

    (tmp_path / "sub").mkdir()
    spec_file = tmp_path / "sub" / "job.yaml"
    spec_file.write_text(Path(DEMO).read_text())
    (tmp_path / "sub" / "rewards.py").write_text("def score(completions, **kw):\n    return [1.0] * len(completions)\n")
    fn = "reward.functions=[{fn: rewards.py:score}, {fn: pkg.mod:score}]"
    spec = load_spec(spec_file, [*GRPO, fn], files=False)
    assert spec.reward.functions[0].fn == f"{tmp_path / 'sub' / 'rewards.py'}:score"
    assert spec.reward.functions[1].fn == "pkg.mod:score"  # a module is imported, not a file
    monkeypatch.chdir(tmp_path)
    relative = load_spec("sub/job.yaml", [*GRPO, fn], files=False)
    assert relative.reward.functions[0].fn == "sub/rewards.py:score"
    assert absolutize(relative).reward.functions[0].fn == f"{tmp_path / 'sub' / 'rewards.py'}:score"  # the workers'


def test_a_missing_reward_file_is_one_line_naming_the_function(tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(Path(DEMO).read_text().replace("examples/", f"{Path.cwd()}/examples/"))
    with pytest.raises(SpecError) as e:
        load_spec(spec_file, [*GRPO, "reward.functions=[{fn: nope.py:score}]"])
    assert f"reward.functions.0.fn: file not found: {tmp_path / 'nope.py'}" in str(e.value)


def test_data_prepare_refuses_a_grpo_spec_in_one_line(tmp_path, capsys):
    from orchestrator.cli import main

    out = tmp_path / "out"
    code = main(["data", "prepare", DEMO, *GRPO, f"run.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "objective.name=grpo has no data cache" in err[0], err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_log_rollouts_every_is_grpos_and_absent_from_other_specs():
    assert "log_rollouts_every" not in load_spec(DEMO, files=False).to_dict()["run"]
    assert grpo("run.log_rollouts_every=5").to_dict()["run"]["log_rollouts_every"] == 5
    with pytest.raises(SpecError, match="run.log_rollouts_every applies to objective.name=grpo only"):
        load_spec(DEMO, ["run.log_rollouts_every=5"], files=False)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("lora.use_dora=true", "rollout.engine=vllm serves a plain LoRA adapter on the saved base: lora.use_dora"),
        ("lora.init=pissa", "lora.init=pissa (it rewrites the base) is not one"),
        ("model.quantization=nf4", "model.quantization=nf4 is not supported with it; use rollout.engine=hf"),
    ],
)
def test_a_policy_vllm_cannot_serve_is_refused_in_one_line(override, says):
    with pytest.raises(SpecError, match=re.escape(says)):
        grpo("model.name=/models/base", "rollout.engine=vllm", override)


def test_vllm_without_its_environment_or_a_url_says_how_to_build_it(tmp_path, monkeypatch):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    monkeypatch.setenv("RAYFT_VLLM_ENV", str(tmp_path / "no-env"))
    vllm = [f"model.name={tmp_path / 'base'}", "rollout.engine=vllm"]
    with pytest.raises(SpecError) as e:
        grpo(*vllm, files=True)
    assert f"rollout.engine: vllm: no vLLM environment at {tmp_path / 'no-env'}: run `make vllm-env`" in str(e.value)
    assert grpo(*vllm, "rollout.vllm_url=http://10.0.0.5:8000/", files=True).rollout.vllm_url == "http://10.0.0.5:8000"


def test_a_prompt_line_that_is_not_usable_json_is_one_line_naming_it(tmp_path):
    """Prompt files are read by the data's one JSONL reader (`jobs.data.sources.json_lines`): a line
    nested too deeply, or not JSON, is one SpecError naming the file and line, never a traceback."""
    from jobs.data.prompts import prompt_records

    bad = tmp_path / "prompts.jsonl"
    for line, says in (("[" * 100_000 + "]" * 100_000, "nested too deeply"), ("{oops", "not valid JSON")):
        bad.write_text('{"prompt": "Capital of Peru?"}\n' + line + "\n")
        with pytest.raises(SpecError) as e:
            list(prompt_records(grpo(f"data.path={bad}")))
        assert f"data.path: {bad} line 2: {says}" in str(e.value) and "\n" not in str(e.value)


def test_the_importance_correction_is_in_the_resume_key_and_older_checkpoints_resume_without_it():
    """It changes what a step trains: a checkpoint of a run without it refuses a resume with it; a
    checkpoint written before the settings existed holds the defaults, what its run trained with."""
    from jobs.run import checkpoint as ckpt

    vllm = ["model.name=/models/base", "rollout.engine=vllm", "rollout.vllm_url=http://127.0.0.1:8000"]
    without, spec_with = grpo(*vllm), grpo(*vllm, "rollout.importance_correction=true")
    saved = ckpt.resume_key(without)
    ckpt.check_resumable(saved, without, "ckpt")
    for changed in (spec_with, grpo(*vllm, "rollout.importance_correction_cap=2")):
        with pytest.raises(SpecError, match=r"ckpt: cannot resume.*rollout: .*'importance_correction"):
            ckpt.check_resumable(saved, changed, "ckpt")
    # where the engine is and how long it may take is not in the key: a resume may reach another one
    moved = grpo(*vllm[:2], "rollout.vllm_url=http://10.0.0.5:9000", "rollout.vllm_timeout_s=9")
    ckpt.check_resumable(saved, moved, "ckpt")
    older = dict(saved, rollout={k: v for k, v in saved["rollout"].items() if not k.startswith("importance")})
    ckpt.check_resumable(older, without, "ckpt")
    with pytest.raises(SpecError, match="cannot resume"):
        ckpt.check_resumable(older, spec_with, "ckpt")
