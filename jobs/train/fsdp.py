"""FSDP2 for the training loop: sharding, the gradient-sync gate, and strategy-free state dicts.

`resources.strategy=fsdp` shards the frozen base over the workers with
`torch.distributed.fsdp.fully_shard`, in torchtitan's units (`units`): the input embeddings, one
unit per decoder layer (its weights are gathered just before the layer runs and freed after it),
and [final norm, LM head]; the root (the loss module) is left with no parameters of its own, so
nothing of the base stays gathered beyond the layers in flight. The LoRA parameters live in the
layers' units, sharded too; the optimizer steps on the shards.

The accumulation rule is DDP's: `set_requires_gradient_sync(False)` on every micro-step but the
last of a window, so gradients accumulate unsharded on each rank and are reduce-scattered once
per optimizer step. FSDP2 averages over the ranks like DDP, so the loop's W / T loss scale gives
the big-batch gradient under both strategies.

Checkpoints do not depend on the strategy: `adapter_state` gathers the full LoRA and optimizer
state (keyed by parameter name) on rank 0 through `torch.distributed.checkpoint.state_dict`,
and `load_adapter_state` scatters it back into whichever layout this run has (DDP replicas or
FSDP shards of any worker count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn


def causal_lm(model: nn.Module) -> Any:
    """The HF causal LM under a PEFT wrapper (or the model itself); typed Any: transformers' and
    PEFT's attributes are not typed."""
    m: Any = model
    return m.get_base_model() if hasattr(m, "get_base_model") else m


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a (PEFT-wrapped) HF causal LM: the units FSDP shards one by one."""
    base = causal_lm(model)
    layers = getattr(base.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        from jobs.errors import SpecError

        raise SpecError(
            f"resources.strategy=fsdp: cannot find the decoder layers of {type(base).__name__} "
            "(expected a `layers` list under its base model); use strategy ddp"
        )
    return layers


def mixed_precision(precision: str) -> Any:
    """FSDP2's policy for the compute precision. bf16/fp16: the gathered weights (base and LoRA)
    are in the compute dtype -- what autocast would cast them to anyway -- and gradients are
    reduced in fp32, so the sharded fp32 LoRA weights get an fp32 gradient as under DDP. fp32:
    nothing is cast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


@dataclass(frozen=True)
class Units:
    """The FSDP units of a causal LM, in forward order, as `shard` makes them.

    `embeddings`: the input embeddings alone, resharded after forward as the layers are, and never
    gathered in backward (frozen, and their input is token ids: backward needs nothing of them;
    kept, they are freed at the end of backward). `layers`: one unit per decoder layer, resharded
    after forward as the plan says. `head`: the final norm(s) and the LM head, kept gathered from
    their forward into their backward, which follows at once (resharding them would only
    all-gather them again: torchtitan's default). Tied embeddings (one weight for both ends)
    cannot be in two units: then `embeddings` is None and `head` holds the input embeddings too,
    gathered from the embedding lookup to the end of backward (FSDP2 frees a unit after the
    backward of its first module, and the embedding lookup has none)."""

    embeddings: nn.Module | None  # None: tied, in `head`
    layers: tuple[nn.Module, ...]
    head: tuple[nn.Module, ...]

    @property
    def tied(self) -> bool:
        return self.embeddings is None

    def all(self) -> list:
        """Every unit, in forward order: a module, or a list of modules sharded as one."""
        return [m for m in (self.embeddings, *self.layers, list(self.head)) if m is not None]


def units(model: nn.Module) -> Units:
    """The units of a (PEFT-wrapped) HF causal LM: its input embeddings, decoder layers, and
    the rest of its decoder stack with parameters (the final norm) beside the LM head."""
    base = causal_lm(model)
    layers = decoder_layers(model)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    norms = tuple(
        m
        for m in base.base_model.children()
        if m is not layers and m is not embed and any(True for _ in m.parameters())
    )
    if head.weight is embed.weight:
        return Units(None, tuple(layers), (embed, *norms, head))
    return Units(embed, tuple(layers), (*norms, head))


def shard(
    module: nn.Module,
    model: nn.Module,
    precision: str,
    reshard_after_forward: bool,
    device: torch.device,
    world_size: int,
) -> nn.Module:
    """`fully_shard` the `units` of `model`, then `module` (the loss wrapper around it) as the
    root, over all `world_size` ranks; each rank's shards go to `device` (the whole base never has
    to fit on one GPU). Activation checkpointing must already be on (as torchtitan does:
    checkpoint, then shard), so a recomputed layer gathers its weights through FSDP's pre-backward
    hook. `reshard_after_forward` (the plan's): free each decoder layer's (and the embeddings')
    gathered weights after its forward and gather them again for backward (less memory, one more
    all-gather per layer); the head keeps its own (`Units`). Kept gathered, a forward without
    backward (evaluation) all-gathers nothing after the first. `jobs.memory` counts what is
    gathered at the peak from these same rules (`fsdp_gathered`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    mp = mixed_precision(precision)
    u = units(model)
    if u.embeddings is not None:
        embeddings = fully_shard(u.embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        embeddings.set_unshard_in_backward(False)
    for layer in u.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(list(u.head), mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return module


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gradient_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """The micro-step's gate: gradients are reduce-scattered only when `sync` (the last
    micro-step of a window); otherwise they accumulate unsharded on this rank."""
    cast(Any, module).set_requires_gradient_sync(sync)  # an FSDPModule (fully_shard mixes it in)
    yield


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of `params` to a total norm of `max_norm`; returns the total norm
    before clipping as a plain tensor. Sharded (DTensor) gradients: the per-shard norms are
    combined over the ranks (`full_tensor`) into the norm of the whole gradient, the same
    number DDP computes from its replicas, and every rank scales its shard by the same factor
    (torchtitan's recipe)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, ignore_frozen_params=True, **kw)


def adapter_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Every rank calls this (it gathers shards); rank 0 gets the full trainable (LoRA) state and
    the full optimizer state keyed by parameter name, on the CPU. Other ranks get empty dicts.
    The same call under DDP, FSDP or one process gives the same names and shapes, which is what
    lets a checkpoint resume under another strategy or worker count."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    adapter, optim_state = get_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return _trainable_only(model, adapter), optim_state


def full_adapter(model: nn.Module) -> dict:
    """The full trainable (LoRA) state, keyed like `model.state_dict()`, on rank 0 on the CPU
    ({} on other ranks). Every rank calls it: under FSDP it gathers the shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return _trainable_only(model, get_model_state_dict(model, options=_options(cpu_offload=True)))


def _trainable_only(model: nn.Module, state: dict) -> dict:
    """`ignore_frozen_params` drops the frozen parameters but not the extra state modules write
    beside them: bitsandbytes' 4-bit layers (QLoRA) add their quantization constants
    (`weight.absmax`, `weight.quant_map`, ...), which belong to the base, not to the adapter."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def load_adapter_state(model: nn.Module, optimizer: torch.optim.Optimizer, adapter: dict, optim_state: dict) -> None:
    """Load a full state (as `adapter_state` returns it; every rank passes the same) into this
    run's parameters and optimizer, whether they are replicas or FSDP shards. A stateless
    optimizer (SGD without momentum) saved no per-parameter state: there is none to restore (its
    hyperparameters are the spec's and the lr is set every step), and torch's loader asserts on
    an empty one, so only the parameters are loaded."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if isinstance(optim_state, dict) and not optim_state.get("state") and _stateless(optimizer):
        set_model_state_dict(model, adapter, options=_options())
        return
    set_state_dict(model, optimizer, model_state_dict=adapter, optim_state_dict=optim_state, options=_options())


def _stateless(optimizer: torch.optim.Optimizer) -> bool:
    """SGD without momentum keeps no per-parameter state between steps."""
    return isinstance(optimizer, torch.optim.SGD) and all(not g.get("momentum") for g in optimizer.param_groups)
