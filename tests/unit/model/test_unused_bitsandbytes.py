"""`hide_unused_bitsandbytes` (jobs/model/loading.py), as every Ray Train worker calls it first: a
run without `model.quantization` never imports bitsandbytes, and its adapter is the same, bit for
bit, as the one a process with bitsandbytes builds; a quantized run's worker imports it as before.
Each case is a fresh process (a worker is one: hiding a package in this test process would change
what PEFT supports for every later test in it)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from gradtools import ROOT
from safetensors.torch import load_file

SCRIPT = """
import json, sys
from jobs.model.loading import add_lora, hide_unused_bitsandbytes, load_base_model
from jobs.spec import load_spec

how, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
spec = load_spec("examples/tiny-lora.yaml", overrides, files=False)
if how == "hide":
    hide_unused_bitsandbytes(spec.model.quantization)
if spec.model.quantization == "none":
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    model = add_lora(load_base_model(spec, "fp32")[0], spec)
    save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}, out)
    layers = sorted({type(m).__module__ + "." + type(m).__name__ for m in model.modules() if hasattr(m, "lora_A")})
else:
    import peft  # noqa: F401  (what a worker imports before it quantizes)

    layers = []
from peft.import_utils import is_bnb_available

imported = getattr(sys.modules.get("bitsandbytes"), "__name__", None)
print("RESULT", json.dumps({"bitsandbytes": imported, "peft_sees_it": is_bnb_available(), "layers": layers}))
"""


def _worker(how: str, out, *overrides: str) -> dict:
    argv = [sys.executable, "-c", SCRIPT, how, str(out), *overrides]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


def test_a_run_without_quantization_never_imports_bitsandbytes_and_builds_the_same_adapter(tmp_path):
    hidden = _worker("hide", tmp_path / "hidden.safetensors")
    assert hidden["bitsandbytes"] is None and hidden["peft_sees_it"] is False
    plain = _worker("keep", tmp_path / "plain.safetensors")
    # the oracle sees a difference: without the call, PEFT imports bitsandbytes
    assert plain["bitsandbytes"] == "bitsandbytes" and plain["peft_sees_it"] is True
    assert hidden["layers"] == plain["layers"] and hidden["layers"] == ["peft.tuners.lora.layer.Linear"]
    a, b = load_file(tmp_path / "hidden.safetensors"), load_file(tmp_path / "plain.safetensors")
    assert a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a)


def test_a_quantized_run_keeps_bitsandbytes():
    got = _worker("hide", "-", "model.quantization=nf4")
    assert got["bitsandbytes"] == "bitsandbytes" and got["peft_sees_it"] is True
