"""Every save a run or an export makes is read back and compared before it reports success.

Invariants:

* The trained parameters are the ones the optimizer steps, found by identity in its parameter
  groups -- never by `requires_grad`, which is the flag a bug can lose (issue 49: an FSDP DPO run
  whose LoRA shards were left frozen saved an adapter of no tensors and exited 0).
* A saved adapter state holds exactly the trained parameters: the same names, as many, the same
  shapes and dtypes, and bit-equal values (except the best step's adapter under early stopping:
  the trained parameters are then the last step's, so only names, shapes and dtypes are compared).
* What was written is read back from disk and is bit-equal to what was meant to be written: the
  final `adapter/` (in PEFT's names), each checkpoint's adapter file, an export (an adapter copy,
  or the merged model, where a tensor tied to a saved one may be left out).
* A difference is one `RunError` line (exit 1) naming the save and the first difference.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from jobs.errors import RunError, error_line

# Module wrappers that torch's state-dict helpers leave out of a parameter's name.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP shard (DTensor) is gathered, a collective over its mesh."""
    from torch.distributed.tensor import DTensor

    t = p.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def trained_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """{name: whole tensor, on the CPU} of the parameters `optimizer` steps, keyed as the model
    names them; on rank 0 ({} elsewhere). Every rank calls it: under FSDP each shard is gathered,
    in `named_parameters` order, the same on every rank."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    main, out = _is_main(), {}
    for name, p in model.named_parameters():
        if id(p) in stepped:
            whole = _full(p)
            if main:
                out[_clean(name)] = whole.cpu().clone()
    return out


def state_problem(
    saved: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], values: bool = True
) -> str | None:
    """The first way `saved` differs from `want` (names, count, shape, dtype, then values), or None."""
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    if missing or extra:
        first = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        return f"holds {len(saved)} tensors where {len(want)} were trained ({first})"
    for name, w in want.items():
        s = saved[name]
        if tuple(s.shape) != tuple(w.shape) or s.dtype != w.dtype:
            return f"{name} is {s.dtype} {tuple(s.shape)}, trained {w.dtype} {tuple(w.shape)}"
        if values and not torch.equal(s, w):
            return (
                f"{name} differs from the trained value (max |diff| {float((s.double() - w.double()).abs().max()):g})"
            )
    return None


def fail_if(problem: str | None, where: str) -> None:
    if problem:
        raise RunError(error_line(f"{where}: {problem}; the save is not complete, the run is not reported done"))


def check_state(
    saved: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor], where: str, values: bool = True
) -> None:
    """`saved` (a state about to be written) holds exactly the trained parameters, or a RunError."""
    fail_if(state_problem(saved, trained, values), where)


def read_back(*files: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors `files`, read from disk; a file that does not read is a RunError."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error type, OSError, or ValueError
            fail_if(f"cannot be read back ({type(e).__name__}: {str(e)[:200]})", str(f))
    return out


def check_file(path: Path, written: Mapping[str, torch.Tensor]) -> None:
    """The safetensors file `path` reads back bit-equal to `written`, or a RunError naming it."""
    fail_if(state_problem(read_back(path), written), str(path))


def check_adapter_dir(adapter_dir: Path, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """`adapter_dir/adapter_model.safetensors` (written by PEFT's `save_pretrained` from `state`)
    reads back as `state` in PEFT's names (the adapter name dropped), tensor for tensor."""
    from peft import get_peft_model_state_dict

    want = get_peft_model_state_dict(model, state_dict=dict(state), adapter_name="default")
    where = str(adapter_dir / "adapter_model.safetensors")
    if len(want) != len(state):
        fail_if(f"PEFT names {len(want)} of the {len(state)} trained tensors", where)
    check_file(adapter_dir / "adapter_model.safetensors", want)


def check_merged(directory: Path, model: nn.Module) -> None:
    """The merged model's safetensors files in `directory` read back as `model`'s state dict; a
    tensor left out is one tied to a saved tensor (the same storage in `model`)."""
    saved = read_back(*sorted(directory.glob("*.safetensors")))
    state = model.state_dict()
    kept_ptrs = {state[k].data_ptr() for k in saved if k in state}
    want = {k: v for k, v in state.items() if k in saved or v.data_ptr() not in kept_ptrs}
    fail_if(state_problem(saved, want), str(directory))
