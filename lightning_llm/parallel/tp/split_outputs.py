"""Refuse, in a block's first forward, a column-split layer whose output the model cuts into parts.

A plain column split (``colwise``) gives each rank a contiguous slice of a layer's outputs. That is right
when the model reshapes the output into heads (each rank's slice is whole heads) and wrong when the model
cuts the output into parts along its last dimension (``split``/``chunk``/slicing: a state-space mixer's
input projection cut into x, z, B, C and dt; a fused gate|up): rank 0 would get all of the first parts,
rank 1 the rest, and the model's split sizes, read from its config, no longer match. Names and shapes
cannot tell the two apart, so the first forward of each block watches the outputs of its column-split
layers with a ``TorchFunctionMode`` and raises, before the cutting op runs and before any optimizer
step, naming the layer, the parts and the plan entries that work (its parts' sizes as
``fused_colwise:A,B,...`` when each part is split per head, or the whole part kept whole).
Fused styles regroup their output so that each rank holds its share of every part: they pass.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_CUTS = {
    torch.split,
    torch.Tensor.split,
    torch.chunk,
    torch.Tensor.chunk,
    torch.tensor_split,
    torch.Tensor.tensor_split,
    torch.Tensor.split_with_sizes,
    torch.narrow,
    torch.Tensor.narrow,
    torch.unbind,
    torch.Tensor.unbind,
}


def _last_dim(x: torch.Tensor, dim) -> bool:
    return isinstance(dim, int) and dim in (-1, x.dim() - 1)


def _cut_dim(func, args, kwargs) -> object:
    if func in (torch.narrow, torch.Tensor.narrow):
        return kwargs.get("dim", args[1] if len(args) > 1 else None)
    if func in (torch.unbind, torch.Tensor.unbind):
        return kwargs.get("dim", args[1] if len(args) > 1 else 0)
    return kwargs.get("dim", args[2] if len(args) > 2 else 0)


def _slices_last_dim(x: torch.Tensor, index) -> bool:
    index = index if isinstance(index, tuple) else (index,)
    if not index or not isinstance(index[-1], slice) or index[-1] == slice(None):
        return False
    return Ellipsis in index or len(index) == x.dim()


class _WatchCuts(TorchFunctionMode):
    def __init__(self, watched: dict[int, tuple[weakref.ref, str]], label: str) -> None:
        super().__init__()
        self.watched, self.label = watched, label

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        ref, name = self.watched.get(id(x), (None, None))
        if ref is not None and ref() is x:  # the watched tensor itself, not a later one at a reused address
            if func in _CUTS and _last_dim(x, _cut_dim(func, args, kwargs)):
                raise RuntimeError(_message(self.label, name, x, func.__name__))
            if func is torch.Tensor.__getitem__ and _slices_last_dim(x, args[1]):
                raise RuntimeError(_message(self.label, name, x, "slicing"))
        return func(*args, **kwargs)


def _message(label: str, name: str, x: torch.Tensor, how: str) -> str:
    owner = name.rpartition(".")[0]  # the module holding the layer: keep the whole mixer whole (the block itself)
    owner = f"{label}.{owner}" if owner else label
    return (
        f"Tensor parallelism: {label}.{name} is split column-wise ('colwise'), but the model cuts its output into "
        f"parts ({how} along the last dimension; this rank holds {x.shape[-1]} of its columns), so each rank would "
        "get whole parts instead of its share of every part. Name its layout in tensor_parallel_plan: "
        f"{{'{label}.{name}': 'fused_colwise:A,B,...'}} with the parts' sizes when each part is split per head, or "
        f"keep it whole: tensor_parallel_replicate=['{owner}']."
    )


def watch_first_forward(block: nn.Module, colwise: list[str], label: str) -> None:
    """Watch the outputs of ``colwise`` (names inside ``block``) during ``block``'s first forward.

    Example::

        watch_first_forward(model.layers[0], ["mixer.in_proj", "self_attn.q_proj"], "model.layers.0")
    """
    if not colwise:
        return
    watched: dict[int, tuple[weakref.ref, str]] = {}

    def record(name: str, out) -> None:
        if isinstance(out, torch.Tensor):
            watched[id(out)] = (weakref.ref(out), name)

    handles = [block.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: record(n, out)) for n in colwise]
    mode = _WatchCuts(watched, label)

    def enter(module, args):
        mode.__enter__()

    def leave(module, args, output):
        mode.__exit__(None, None, None)
        for handle in handles:
            handle.remove()

    # always_call: the mode leaves the stack even when the forward raises (our refusal included).
    handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave, always_call=True)]
