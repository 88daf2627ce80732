"""The starting adapter (`model.adapter`) is checked before anything is created (issue 49 item 3):
every adapter_config key that changes training is either compared with `lora.*` or must be unset,
the weights are a whole safetensors file, and a pickle-only adapter is refused. Before, the keys
beyond r / alpha / DoRA / rsLoRA changed training without a word (`lora_dropout`,
`layers_to_transform`, ...), and `modules_to_save`, a cut or padded weights file and a pickle gave
tracebacks after the output directory was claimed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gradtools import ROOT
from safetensors.torch import save_file

from jobs.errors import SpecError
from jobs.model.loading import starting_adapter_config
from jobs.spec import DEFAULT_TARGET_MODULES, load_spec

SPEC = ROOT / "examples" / "tiny-lora.yaml"  # lora: r 16, alpha 32, dropout 0.0, the default targets


def _adapter(directory: Path, **config) -> Path:
    """An adapter directory `lora.*` of the demo spec describes, with `config` over its config."""
    directory.mkdir()
    cfg = {"peft_type": "LORA", "r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0}
    cfg |= {"target_modules": list(DEFAULT_TARGET_MODULES), "bias": "none", "modules_to_save": None, **config}
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(16, 4)}, str(directory / "adapter_model.safetensors"))
    return directory


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


CONFIG_CASES = [
    ({"lora_dropout": 0.1}, "lora_dropout=0.1 but lora.dropout=0.0"),
    ({"layers_to_transform": [0]}, "sets layers_to_transform=[0]"),
    ({"modules_to_save": ["lm_head"]}, "sets modules_to_save=['lm_head']"),
    ({"rank_pattern": {"q_proj": 4}}, "sets rank_pattern="),
    ({"bias": "all"}, "sets bias='all'"),
]
FILE_CASES = [
    (_cut, "has a broken entry in the header"),  # its offsets run past the cut end
    (_padded, "bytes past its tensors"),
    (_pickle_only, "adapter_model.bin only (a pickle)"),
]


def test_an_adapter_the_spec_describes_passes(tmp_path):
    _check(_adapter(tmp_path / "a"))  # PEFT's own neutral values ("none", null, {}) pass


@pytest.mark.parametrize("config,fragment", CONFIG_CASES, ids=[next(iter(c)) for c, _ in CONFIG_CASES])
def test_a_config_key_that_changes_training_is_refused(tmp_path, config, fragment):
    with pytest.raises(SpecError, match="model.adapter: ") as e:
        _check(_adapter(tmp_path / "a", **config))
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage,fragment", FILE_CASES, ids=[d.__name__ for d, _ in FILE_CASES])
def test_weights_that_are_not_a_whole_safetensors_file_are_refused(tmp_path, damage, fragment):
    adapter = _adapter(tmp_path / "a")
    damage(adapter)
    with pytest.raises(SpecError, match="model.adapter: ") as e:
        _check(adapter)
    assert fragment in str(e.value)


def test_rayft_run_refuses_before_anything_is_created(tmp_path):
    """End to end: `modules_to_save` gave a traceback after the output directory was claimed."""
    adapter = _adapter(tmp_path / "a", modules_to_save=["lm_head"])
    out = tmp_path / "run"
    cmd = [str(Path(sys.executable).parent / "rayft"), "run", str(SPEC), f"model.adapter={adapter}"]
    cmd += [f"run.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "resources.num_workers=1", "--local"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "modules_to_save" in lines[0], r.stderr[-2000:]
    assert not out.exists()
