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

The same watch follows the output through its reshape into heads (``view``/``transpose``/``permute``, a KV
cache's ``cat``) and refuses a ``split``/``chunk`` of the head axis itself: differential attention pairs head
``i`` with head ``i + n/2``, which a split by heads puts on another rank.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_llm.parallel.tp.coverage import wildcard_index

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
        self.headed: dict[int, tuple[weakref.ref, str, int]] = {}  # views of watched outputs -> their head axis

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        ref, name = self.watched.get(id(x), (None, None))
        if ref is not None and ref() is x:  # the watched tensor itself, not a later one at a reused address
            if func in _CUTS and _last_dim(x, _cut_dim(func, args, kwargs)):
                raise RuntimeError(_message(self.label, name, x, func.__name__))
            if func is torch.Tensor.__getitem__ and _slices_last_dim(x, args[1]):
                raise RuntimeError(_message(self.label, name, x, "slicing"))
        head_ref, head_name, heads = self.headed.get(id(x), (None, None, None))
        headed = head_ref is not None and head_ref() is x
        if headed and func in _GROUPS and _normalized(x, _cut_dim(func, args, kwargs)) == heads:
            raise RuntimeError(_heads_message(self.label, head_name, x.shape[heads], func.__name__))
        result = func(*args, **kwargs)
        if ref is not None and ref() is x:
            self._follow(result, name, _heads_axis(func, x, result))
        elif headed:
            self._follow(result, head_name, _moved_axis(func, args, kwargs, x, result, heads))
        elif func in _CATS and isinstance(x, (list, tuple)):
            self._follow_cat(x, kwargs.get("dim", args[1] if len(args) > 1 else 0), result)
        return result

    def _follow_cat(self, parts, dim, result) -> None:
        """A KV cache appends the new keys/values along the sequence: the head axis carries over."""
        for part in parts:
            ref, name, heads = self.headed.get(id(part), (None, None, None))
            if ref is not None and ref() is part and _normalized(part, dim) != heads:
                self._follow(result, name, heads)
                return

    def _follow(self, result, name: str, heads: int | None) -> None:
        """Track the head axis of a view of a watched output (``view``/``transpose``/``permute``)."""
        if heads is not None and isinstance(result, torch.Tensor):
            self.headed[id(result)] = (weakref.ref(result), name, heads)


_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten, torch.unflatten}
# Cutting the head axis into groups (unbind, one head at a time, stays per head and passes).
_GROUPS = {torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.Tensor.split_with_sizes}
_CATS = {torch.cat, torch.concat, torch.concatenate}
_KEEPS = {torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.float, torch.Tensor.to}


def _normalized(x: torch.Tensor, dim) -> int | None:
    return dim % x.dim() if isinstance(dim, int) and x.dim() else None


def _heads_axis(func, x: torch.Tensor, result) -> int | None:
    """The head axis of ``result`` when ``func`` reshapes the last dimension of ``x`` into (heads, head_dim)."""
    if func not in _VIEWS or not isinstance(result, torch.Tensor) or result.dim() != x.dim() + 1:
        return None
    if result.shape[:-2] != x.shape[:-1]:
        return None
    return result.dim() - 2


def _moved_axis(func, args, kwargs, x: torch.Tensor, result, heads: int) -> int | None:
    """Where the head axis of ``x`` lands in ``result`` through a transpose, permute or copy; else ``None``."""
    if not isinstance(result, torch.Tensor) or result.dim() != x.dim():
        return None
    if func in _KEEPS:
        return heads
    if func in (torch.transpose, torch.Tensor.transpose):
        a, b = (_normalized(x, d) for d in (args[1:3] if len(args) >= 3 else (kwargs.get("dim0"), kwargs.get("dim1"))))
        return b if heads == a else a if heads == b else heads
    if func is torch.Tensor.permute:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        order = [_normalized(x, d) for d in dims]
        return order.index(heads) if heads in order else None
    return None


def _heads_message(label: str, name: str, held: int, how: str) -> str:
    owner = name.rpartition(".")[0]
    owner = f"{label}.{owner}" if owner else label
    return (
        f"Tensor parallelism: {label}.{name} is split column-wise by heads (this rank holds {held} of them), but the "
        f"model cuts its heads into groups ({how} along the head axis; differential attention pairs the first half "
        "of the heads with the second), so each rank would pair its own heads instead. Keep the attention whole: "
        f"tensor_parallel_replicate=['{wildcard_index(owner)}'], or use pipeline parallelism or ZeRO for this model."
    )


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
