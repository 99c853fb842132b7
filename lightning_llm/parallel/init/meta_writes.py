"""Values a ``configure_model`` writes into parameters built on the meta device, kept and written back after setup.

The strategy builds the model on the meta device (nothing is allocated until each rank holds only its shards),
where a ``copy_`` does nothing: a ``configure_model`` that loads known weights (``load_state_dict``, ``copy_`` from a
real tensor) would train from the model's fresh init without a word, while Lightning's ``ModelParallelStrategy``,
building eagerly, keeps them. :class:`MetaWrites` watches the build for copies from real tensors into meta ones;
:func:`write_back` puts those values into the sharded, materialized parameters (each rank its own slice). Copies
into a layer that tensor parallelism regroups cannot be placed and are refused; copies into part of a parameter are
warned about.
"""

from __future__ import annotations

import fnmatch
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_llm._compat.torch import TorchDispatchMode
from lightning_llm.parallel.tp.plan import is_fused_style


class MetaWrites(TorchDispatchMode):
    """Records ``copy_`` from a real tensor into a meta tensor while active: ``{id(destination): (dest, source)}``."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].is_meta and not args[1].is_meta:
            self.copies[id(args[0])] = (args[0], args[1].detach().clone())
        return func(*args, **(kwargs or {}))

    def by_name(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The recorded values by parameter/buffer name of ``module``; refuses copies into anything else."""
        names = {id(t): n for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]}
        unplaced = [tuple(dest.shape) for key, (dest, _) in self.copies.items() if key not in names]
        if unplaced:  # a view of a parameter, or a scratch tensor a library's init fills: said, not refused
            warnings.warn(
                f"configure_model copied real values into {len(unplaced)} meta tensor(s) that are not whole parameters "
                f"or buffers of the model (shapes {unplaced[:5]}); the strategy cannot keep them after sharding. If "
                "they are weights you load, copy whole parameters (`load_state_dict`, `param.copy_(...)`) or use "
                "LLMParallelStrategy(load_pretrained=...).",
                stacklevel=2,
            )
        return {names[key]: source for key, (_, source) in self.copies.items() if key in names}


@torch.no_grad()
def write_back(module: nn.Module, values: dict[str, torch.Tensor], regrouped: set[str] = frozenset()) -> list[str]:
    """Copy ``values`` (name -> whole tensor) into ``module``'s materialized, possibly sharded tensors.

    Each rank takes its own slice of each value (no communication); tensors absent on this rank (another pipeline
    stage's) are skipped. ``regrouped``: module names whose tensor-parallel style reorders rows, refused.
    """
    refused = sorted(n for n in values if n.rpartition(".")[0] in regrouped)
    if refused:
        raise ValueError(
            f"configure_model loaded values into {refused[:5]}, whose tensor-parallel layout regroups their rows; "
            "the strategy cannot place them. Load the weights with LLMParallelStrategy(load_pretrained=...), or "
            "after setup."
        )
    tensors = dict([*module.named_parameters(remove_duplicate=False), *module.named_buffers()])
    written = []
    for name, value in sorted(values.items()):
        target = tensors.get(name)
        if target is None:
            continue
        value = value.to(device=target.device, dtype=target.dtype)
        if isinstance(target, DTensor):
            part = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(part.to_local())
        elif target.shape == value.shape:
            target.copy_(value)
        else:
            raise ValueError(
                f"configure_model loaded a {tuple(value.shape)} value into {name!r}, which this rank holds as a "
                f"{tuple(target.shape)} slice the strategy cannot place it in. Load the weights with "
                "LLMParallelStrategy(load_pretrained=...), or after setup."
            )
        written.append(name)
    return written


def regrouped_modules(module: nn.Module, tp_plan: dict[str, str]) -> set[str]:
    """Names of ``module``'s submodules whose tensor-parallel style reorders rows (fused and shared-KV styles)."""
    regrouping = [p for p, style in tp_plan.items() if is_fused_style(style) or style.startswith("replicate_shared")]
    return {name for name, _ in module.named_modules() if any(fnmatch.fnmatchcase(name, p) for p in regrouping)}
