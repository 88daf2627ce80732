"""The `objective` section is a union tagged by `objective.name`: one class per objective, each
with only its own keys (with their defaults and documentation), which `rayft spec schema` shows;
the resume key holds exactly the settings of the objective a run trains with."""

from __future__ import annotations

import pytest
from runs import objective_overrides

from jobs.run import checkpoint as ckpt
from jobs.spec import json_schema, load_spec

DEMO = "examples/tiny-lora.yaml"
# Written out here, not read from jobs.spec: what each objective takes, and its defaults.
KEYS = {
    "SFTObjective": {"name": "sft"},
    "DPOObjective": {"name": "dpo", "beta": 0.1, "label_smoothing": 0.0, "rpo_alpha": 0.0, "reference": "adapter_off"},
    "IPOObjective": {"name": "ipo", "beta": 0.1, "reference": "adapter_off"},
    "SimPOObjective": {"name": "simpo", "beta": 0.1, "simpo_gamma": 0.5},
    "ORPOObjective": {"name": "orpo", "beta": 0.1},
    "GRPOObjective": {
        "name": "grpo",
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": None,
        "num_iterations": 1,
        "scale_rewards": "group",
        "importance_sampling_level": "token",
        "mask_truncated_completions": False,
    },
}


def test_each_objective_class_lists_exactly_its_keys_in_the_json_schema():
    schema = json_schema()
    members = [m["$ref"].rsplit("/", 1)[1] for m in schema["properties"]["objective"]["oneOf"]]
    assert sorted(members) == sorted(KEYS)
    for cls, keys in KEYS.items():
        d = schema["$defs"][cls]
        assert d["additionalProperties"] is False, cls
        assert list(d["properties"]) == list(keys), cls
        assert {k: p["default"] for k, p in d["properties"].items()} == keys, cls
        assert all(p.get("description") for p in d["properties"].values()), cls


@pytest.mark.parametrize("cls", sorted(KEYS))
def test_the_spec_resolves_each_objective_to_its_defaults(cls):
    name = KEYS[cls]["name"]
    spec = load_spec(DEMO, objective_overrides(name), files=False)
    assert type(spec.objective).__name__ == cls and spec.objective.model_dump() == KEYS[cls]


def test_the_resume_key_holds_the_objectives_settings_as_trained_but_the_reference_mode():
    key = ckpt.resume_key(load_spec(DEMO, ["objective.name=dpo", "objective.rpo_alpha=1"], files=False))
    got = {k: v for k, v in key.items() if k.startswith("objective.")}
    assert got == {
        "objective.name": "dpo",
        "objective.beta": 0.1,
        "objective.label_smoothing": 0.0,
        "objective.rpo_alpha": 1.0,
    }


def test_a_checkpoint_that_stored_none_for_a_default_still_resumes_and_a_new_setting_is_compared():
    """Checkpoints written before the objective classes stored None for a default (and for a key the
    objective did not take) and had no `objective.rpo_alpha`: they resume the same run, and a run
    that sets rpo_alpha (plain DPO trained before it) is refused."""
    dpo = load_spec(DEMO, ["objective.name=dpo"], files=False)
    old = {k: v for k, v in ckpt.resume_key(dpo).items() if k != "objective.rpo_alpha"}
    old.update({"objective.beta": None, "objective.label_smoothing": None, "objective.simpo_gamma": None})
    ckpt.check_resumable(old, dpo, "ckpt")
    rpo = load_spec(DEMO, ["objective.name=dpo", "objective.rpo_alpha=1"], files=False)
    with pytest.raises(Exception, match=r"objective.rpo_alpha: 0.0 -> 1.0"):
        ckpt.check_resumable(old, rpo, "ckpt")
    precomputed = load_spec(DEMO, ["objective.name=dpo", "objective.reference=precomputed"], files=False)
    ckpt.check_resumable(old, precomputed, "ckpt")  # how the reference is computed, not what


# Another valid value of every setting (written out, like KEYS): a setting missing here fails below.
CHANGED = {
    "beta": 0.05,
    "label_smoothing": 0.1,
    "rpo_alpha": 1.0,
    "simpo_gamma": 0.7,
    "loss_type": "grpo",
    "epsilon": 0.3,
    "epsilon_high": 0.28,
    "num_iterations": 2,
    "scale_rewards": "none",
    "importance_sampling_level": "sequence",
    "mask_truncated_completions": True,
}
RESOLVED_DEFAULT = {"epsilon_high": KEYS["GRPOObjective"]["epsilon"]}


def _settings(cls: str) -> list[str]:
    free = {"reference"}  # `resume_free`: how the reference is computed, not what
    return [k for k in KEYS[cls] if k not in ("name", *free)]


def _spec(name: str, *overrides: str):
    return load_spec(DEMO, [*objective_overrides(name), *overrides], files=False)


@pytest.mark.parametrize("cls", sorted(KEYS))
def test_every_objective_setting_is_in_the_resume_key_resolved(cls):
    """For every setting of every objective: its default written out explicitly (resolved, as
    `epsilon_high` = `epsilon`) resumes the run, and another value is refused naming it."""
    name = KEYS[cls]["name"]
    saved = ckpt.resume_key(_spec(name))
    for key in _settings(cls):
        default = RESOLVED_DEFAULT.get(key, KEYS[cls][key])
        ckpt.check_resumable(saved, _spec(name, f"objective.{key}={default}"), "ckpt")
        assert key in CHANGED, f"objective.{key}: give it another value in CHANGED"
        with pytest.raises(Exception, match=rf"objective\.{key}: "):
            ckpt.check_resumable(saved, _spec(name, f"objective.{key}={CHANGED[key]}"), "ckpt")


def test_a_checkpoint_that_stored_epsilon_high_unresolved_is_resolved_by_its_own_epsilon():
    """A checkpoint holding `epsilon_high: None` trained with its own `epsilon` as the upper bound:
    that value written out resumes it; the bound of the current spec's epsilon does not."""
    saved = ckpt.resume_key(_spec("grpo", "objective.epsilon=0.3"))
    saved["objective.epsilon_high"] = None
    ckpt.check_resumable(saved, _spec("grpo", "objective.epsilon=0.3", "objective.epsilon_high=0.3"), "ckpt")
    with pytest.raises(Exception, match=r"objective\.epsilon_high: 0\.3 -> 0\.2"):
        ckpt.check_resumable(saved, _spec("grpo", "objective.epsilon=0.3", "objective.epsilon_high=0.2"), "ckpt")


def test_the_generation_batch_is_out_of_the_resume_key_and_how_completions_are_drawn_is_in():
    """`rollout.generation_batch_size` changes how completions are computed, not which (each from its
    own seed: tests/unit/objectives/test_grpo_step.py), so a resume may change it; a sampling setting
    changes which, and is refused."""
    saved = ckpt.resume_key(_spec("grpo"))
    assert "generation_batch_size" not in saved["rollout"]
    for n in (1, 7):
        ckpt.check_resumable(saved, _spec("grpo", f"rollout.generation_batch_size={n}"), "ckpt")
    with pytest.raises(Exception, match=r"rollout"):
        ckpt.check_resumable(saved, _spec("grpo", "rollout.top_k=5"), "ckpt")
