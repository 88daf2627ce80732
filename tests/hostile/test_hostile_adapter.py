"""The starting adapter (`model.adapter`) is checked before anything is created (issue 49 item 3):
every adapter_config key that changes training is either compared with `lora.*` or must be unset,
`init_lora_weights` is a plain init, the weights are a whole safetensors file whose tensors have
the shapes the spec's base gives, with both A and B of every targeted layer, and a pickle-only
adapter is refused. Before, the keys beyond r / alpha / DoRA / rsLoRA changed training without a
word (`lora_dropout`, `layers_to_transform`, a PiSSA init, ...), a missing B trained from PEFT's
zero init, and `modules_to_save`, wrong shapes, a cut or padded weights file and a pickle gave
tracebacks after the output directory was claimed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gradtools import ROOT
from safetensors.torch import load_file, save_file

from jobs.errors import SpecError
from jobs.model.loading import starting_adapter_config
from jobs.spec import load_spec

SPEC = ROOT / "examples" / "tiny-lora.yaml"  # lora: r 16, alpha 32, dropout 0.0, the default targets


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """An adapter of tiny-llama as rayft saves one for the demo spec (PEFT's own adapter_config.json)."""
    from jobs.model.loading import add_lora, load_base_model

    spec = load_spec(SPEC, [], files=False)
    directory = tmp_path_factory.mktemp("start") / "adapter"
    add_lora(load_base_model(spec, "fp32")[0], spec).save_pretrained(directory)
    return directory


@pytest.fixture
def adapter(saved, tmp_path):
    """A copy of `saved`, with `config` over its config (`adapter(**config)`)."""

    def copy(**config) -> Path:
        directory = tmp_path / "a"
        shutil.copytree(saved, directory)
        cfg = json.loads((directory / "adapter_config.json").read_text())
        (directory / "adapter_config.json").write_text(json.dumps(cfg | config))
        return directory

    return copy


def _check(adapter: Path) -> None:
    starting_adapter_config(load_spec(SPEC, [f"model.adapter={adapter}"], files=False))


def _cut(adapter: Path) -> None:
    f = adapter / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])


def _padded(adapter: Path) -> None:
    with open(adapter / "adapter_model.safetensors", "ab") as f:
        f.write(b"\0" * 4096)


def _pickle_only(adapter: Path) -> None:
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({"x": torch.zeros(2)}, adapter / "adapter_model.bin")


def _wrong_shape(adapter: Path) -> None:
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = min(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(16, tensors[key].shape[1] + 1)  # PEFT's load refused it on the worker
    save_file(tensors, adapter / "adapter_model.safetensors")


def _b_missing(adapter: Path) -> None:
    tensors = load_file(adapter / "adapter_model.safetensors")
    del tensors[max(k for k in tensors if "lora_B" in k)]  # PEFT left that B at its zero init, silently
    save_file(tensors, adapter / "adapter_model.safetensors")


INITS = ["pissa", "olora", "loftq", "eva", "corda", "pissa_niter_4", 1]
CONFIG_CASES = [
    ({"lora_dropout": 0.1}, "lora_dropout=0.1 but lora.dropout=0.0"),
    ({"layers_to_transform": [0]}, "sets layers_to_transform=[0]"),
    ({"modules_to_save": ["lm_head"]}, "sets modules_to_save=['lm_head']"),
    ({"rank_pattern": {"q_proj": 4}}, "sets rank_pattern="),
    ({"bias": "all"}, "sets bias='all'"),
    # PiSSA, OLoRA, LoftQ, EVA, CorDA move or replace base weights as PEFT builds the layers
    *(({"init_lora_weights": init}, f"adapter_config.json: init_lora_weights={init!r}") for init in INITS),
]
FILE_CASES = [
    (_cut, "has a broken entry in the header"),  # its offsets run past the cut end
    (_padded, "bytes past its tensors"),
    (_pickle_only, "adapter_model.bin only (a pickle)"),
]
SHAPE_CASES = [
    (_wrong_shape, "down_proj.lora_A.weight' has shape [16, 177], not what r=16 and the base's layer (176 -> 64)"),
    (_b_missing, "adapter_model.safetensors: holds no LoRA B of layer 'model.layers.1."),
]


def test_an_adapter_the_spec_describes_passes(adapter):
    _check(adapter())  # PEFT's own saved config (its neutral values: "none", null, {}, true) passes


@pytest.mark.parametrize(
    "config,fragment", CONFIG_CASES, ids=[f"{k}={v}" for c, _ in CONFIG_CASES for k, v in c.items()]
)
def test_a_config_key_that_changes_training_is_refused(adapter, config, fragment):
    with pytest.raises(SpecError, match="model.adapter: ") as e:
        _check(adapter(**config))
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage,fragment", FILE_CASES, ids=[d.__name__ for d, _ in FILE_CASES])
def test_weights_that_are_not_a_whole_safetensors_file_are_refused(adapter, damage, fragment):
    start = adapter()
    damage(start)
    with pytest.raises(SpecError, match="model.adapter: ") as e:
        _check(start)
    assert fragment in str(e.value)


@pytest.mark.parametrize("damage,fragment", SHAPE_CASES, ids=[d.__name__ for d, _ in SHAPE_CASES])
def test_weights_that_do_not_fit_the_spec_base_are_refused(adapter, damage, fragment):
    """Compared with the spec's base built on the meta device: a wrong shape failed only in PEFT's
    load on the worker, after the output directory was claimed; a missing B trained from zero."""
    start = adapter()
    damage(start)
    with pytest.raises(SpecError, match="model.adapter: ") as e:
        _check(start)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage,said", [(None, "modules_to_save"), (_b_missing, "holds no LoRA B of layer")])
def test_rayft_run_refuses_before_anything_is_created(adapter, tmp_path, damage, said):
    """End to end: `modules_to_save` gave a traceback after the output directory was claimed; a
    missing B trained on from PEFT's zero init."""
    start = adapter(modules_to_save=["lm_head"]) if damage is None else adapter()
    if damage is not None:
        damage(start)
    out = tmp_path / "run"
    cmd = [str(Path(sys.executable).parent / "rayft"), "run", str(SPEC), f"model.adapter={start}"]
    cmd += [f"run.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "resources.num_workers=1", "--local"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and said in lines[0], r.stderr[-2000:]
    assert not out.exists()
