"""The one typed job spec.

A job is one YAML file validated into `JobSpec` (pydantic v2, ``extra="forbid"``).
Precedence: defaults < YAML < CLI overrides (``section.field=value``) < Tune trial.

Every user mistake raises `SpecError` whose message is one line naming the field path and the
reason; the CLI prints it and exits with code 2. Nothing in this package touches the file system
except reading the spec, checking that the data files are readable regular files and that a local
model directory holds a model. User YAML is read through `jobs.spec.yaml_file` only: plain data,
bounded in size, depth and alias expansion, no duplicate keys. No float field takes NaN or
infinity, and no string anywhere in a spec may be a credential (`jobs.secrets`).

The package by role: `fields` (the base of every section and the field rules they share),
`sections` (model, data, lora, batch, optim, memory, resources, early stopping, run), `online`
(the rollout and reward sections of online RL), `objective`
(the union tagged by `objective.name`), `job` (`JobSpec`: the rules that join sections),
`loading` (validate, load, check files, the JSON schema) and `yaml_file` (reading YAML and
overrides). This module names what the rest of rayft imports.
"""

from jobs.errors import SpecError
from jobs.spec.fields import DEFAULT_TARGET_MODULES, SpecSection
from jobs.spec.job import JobSpec, compute_precision
from jobs.spec.loading import (
    absolutize,
    check_files,
    json_schema,
    load_spec,
    resolve_model_dir,
    reward_files,
    rewards_beside,
    validate,
)
from jobs.spec.objective import (
    OBJECTIVE_BY_NAME,
    DPOObjective,
    GRPOObjective,
    IPOObjective,
    ORPOObjective,
    SFTObjective,
    SimPOObjective,
)
from jobs.spec.online import RewardFunctionSpec, RewardSpec, RolloutSpec, is_reward_file, user_function
from jobs.spec.sections import Beta, ModelSpec
from jobs.spec.yaml_file import apply_overrides, one_line, path_problem, read_yaml

__all__ = [
    "Beta",
    "DEFAULT_TARGET_MODULES",
    "DPOObjective",
    "GRPOObjective",
    "IPOObjective",
    "JobSpec",
    "ModelSpec",
    "OBJECTIVE_BY_NAME",
    "ORPOObjective",
    "RewardFunctionSpec",
    "RewardSpec",
    "RolloutSpec",
    "SFTObjective",
    "SimPOObjective",
    "SpecError",
    "SpecSection",
    "absolutize",
    "reward_files",
    "rewards_beside",
    "apply_overrides",
    "check_files",
    "compute_precision",
    "json_schema",
    "load_spec",
    "one_line",
    "path_problem",
    "is_reward_file",
    "read_yaml",
    "resolve_model_dir",
    "user_function",
    "validate",
]
