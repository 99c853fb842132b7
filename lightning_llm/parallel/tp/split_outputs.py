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

import sys
import weakref
from typing import NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_llm._compat.torch import tree_leaves
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
    def __init__(
        self, watched: dict[int, tuple[weakref.ref, str]], label: str, heads: tuple[set[int], set[int]] = (set(), set())
    ) -> None:
        super().__init__()
        self.watched, self.label, self.heads = watched, label, heads
        self.headed: dict[int, tuple[weakref.ref, str, int]] = {}  # views of watched outputs -> their head axis
        self.pieces: dict[int, tuple[weakref.ref, _Piece]] = {}  # one head's slice of a headed tensor, and after

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        name = _live(self.watched, x)
        if name is not None:
            if func in _CUTS and _last_dim(x, _cut_dim(func, args, kwargs)):
                raise RuntimeError(_message(self.label, name, x, func.__name__))
            if func is torch.Tensor.__getitem__ and _slices_last_dim(x, args[1]):
                raise RuntimeError(_message(self.label, name, x, "slicing"))
        head_name, heads = _live(self.headed, x) or (None, None)
        cut = head_name is not None and func in _GROUPS and _normalized(x, _cut_dim(func, args, kwargs)) == heads
        if cut and not _one_head_each(func, args, kwargs):
            raise RuntimeError(_heads_message(self.label, head_name, x.shape[heads], func.__name__))
        pieces = [p for t in tree_leaves((args, kwargs)) if (p := _live(self.pieces, t)) is not None]
        merged = self._merge(func, args, kwargs, pieces) if len({p.index for p in pieces}) > 1 else None
        result = self._run(func, args, kwargs)
        if name is not None:
            axis = _heads_axis(func, x, result)
            if axis is not None:
                self._check_count(name, x, result.shape[axis])
            elif isinstance(result, torch.Tensor) and result.shape == x.shape and func not in _VIEWS:
                self.watched[id(result)] = (
                    weakref.ref(result),
                    name,
                )  # element-wise (an activation): still its columns
            self._follow(result, name, axis)
        elif cut:
            for index, piece in enumerate(result):
                self._track(piece, _Piece(head_name, heads, index, x.shape[heads]))
        elif head_name is not None:
            self._follow(result, head_name, _moved_axis(func, args, kwargs, x, result, heads))
        elif merged is not None:
            self._follow(result, *merged)
        elif pieces:
            self._carry(result, pieces[0], func, args, kwargs)
        elif func in _CATS and isinstance(x, (list, tuple)):
            self._follow_cat(x, kwargs.get("dim", args[1] if len(args) > 1 else 0), result)
        return result

    def _run(self, func, args, kwargs):
        """``func``; where it fails on a split layer's output (its columns meeting a tensor that is not split the
        same way: Gemma 4's per-layer input gated by a column-split layer), the failure names the layer and the fix."""
        try:
            return func(*args, **kwargs)
        except RuntimeError as error:
            split = [(t, name) for t in tree_leaves((args, kwargs)) if (name := _live(self.watched, t)) is not None]
            if not split:
                raise
            tensor, name = split[0]
            raise RuntimeError(
                f"Tensor parallelism: {self.label}.{name} is split column-wise (this rank holds {tensor.shape[-1]} of "
                f"its columns), but the model combines its output with a tensor that is not split the same way "
                f"({getattr(func, '__name__', func)}: {error}). Keep it whole, with the layers that read what it "
                f"makes: tensor_parallel_replicate=['{wildcard_index(f'{self.label}.{name}')}', ...], or keep the part "
                "holding them whole."
            ) from error

    def _check_count(self, name: str, x: torch.Tensor, count: int) -> None:
        """A split layer's output viewed into the model's whole head count, not this rank's: the count is written
        into the forward (an einops pattern ``h=8``, a closure), where the plan could not divide it."""
        whole, local = self.heads
        if count in whole and count not in local:
            owner = name.rpartition(".")[0]
            owner = f"{self.label}.{owner}" if owner else self.label
            raise RuntimeError(
                f"Tensor parallelism: {self.label}.{name} is split column-wise (this rank holds {x.shape[-1]} of its "
                f"columns), but the model views them as {count} heads, its whole head count, not this rank's "
                f"({sorted(local)}): the head count is written into the forward (an einops pattern, a closure), where "
                f"tensor parallelism cannot divide it. Keep the attention whole: "
                f"tensor_parallel_replicate=['{wildcard_index(owner)}'], or use ZeRO or pipeline parallelism."
            )

    def _merge(self, func, args, kwargs, pieces: list[_Piece]) -> tuple[str, int]:
        """Heads cut one by one and computed apart may only come back together in order along the head axis
        (a ``cat``): anything else combining two heads' pieces pairs heads, which a split by heads cannot do."""
        parts = args[0] if args else None
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if func in _CATS and isinstance(parts, (list, tuple)) and all(_live(self.pieces, t) for t in parts):
            order = [_live(self.pieces, t) for t in parts]
            axis = order[0].axis
            if axis is not None and _normalized(parts[0], dim) == axis and order == sorted(order, key=_index):
                return order[0].name, axis
        first = pieces[0]
        raise RuntimeError(_heads_message(self.label, first.name, first.held, f"{func.__name__} of two heads' pieces"))

    def _carry(self, result, piece: _Piece, func, args, kwargs) -> None:
        """What one head's piece becomes (a norm, a copy) is still that head's piece."""
        source = next(t for t in tree_leaves((args, kwargs)) if _live(self.pieces, t) is piece)
        for out in tree_leaves(result):
            if isinstance(out, torch.Tensor) and out.dim() == source.dim():
                axis = _moved_axis(func, args, kwargs, source, out, piece.axis) if piece.axis is not None else None
                self._track(out, piece._replace(axis=axis if func in _MOVES else piece.axis))

    def _track(self, tensor, piece: _Piece) -> None:
        if isinstance(tensor, torch.Tensor):
            self.pieces[id(tensor)] = (weakref.ref(tensor), piece)

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


class _Piece(NamedTuple):
    """One head's slice of a headed tensor: the split layer's name, the head axis, the head's index, heads held."""

    name: str
    axis: int | None
    index: int
    held: int


def _index(piece: _Piece) -> int:
    return piece.index


def _live(table: dict, tensor):
    """The entry of ``table`` for ``tensor`` itself (not a later tensor at a reused address), without its ref."""
    entry = table.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    rest = entry[1:]
    return rest[0] if len(rest) == 1 else rest


def _one_head_each(func, args, kwargs) -> bool:
    """Whether a cut along the head axis asks for one head per piece (``split(x, 1)``: StableLM's per-head norms),
    which means each rank's own heads in order under any head count. ``chunk(n)`` asks for ``n`` groups (halves,
    for differential attention), which under a split by heads are other heads on every rank: refused."""
    if func in (torch.split, torch.Tensor.split):
        size = kwargs.get("split_size_or_sections", kwargs.get("split_size", args[1] if len(args) > 1 else None))
        return size == 1 or (isinstance(size, (list, tuple)) and set(size) == {1})
    if func is torch.Tensor.split_with_sizes:
        return set(kwargs.get("split_sizes", args[1] if len(args) > 1 else ())) == {1}
    return False


_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten, torch.unflatten}
# Cutting the head axis into groups (unbind, one head at a time, stays per head and passes).
_GROUPS = {torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.Tensor.split_with_sizes}
_CATS = {torch.cat, torch.concat, torch.concatenate}
_KEEPS = {torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.float, torch.Tensor.to}
_MOVES = {torch.transpose, torch.Tensor.transpose, torch.Tensor.permute}


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


def watch_first_forward(
    block: nn.Module, colwise: list[str], label: str, heads: tuple[set[int], set[int]] = (set(), set())
) -> None:
    """Watch the outputs of ``colwise`` (names inside ``block``) during ``block``'s first forward.

    ``heads``: the head counts the block stated before the plan divided them, and after; a view of a split output
    into a count of the first set that is not in the second is refused.

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
    mode = _WatchCuts(watched, label, heads)

    def enter(module, args):
        mode.__enter__()

    def leave(module, args, output):
        mode.__exit__(None, None, None)
        if sys.exc_info()[1] is None:  # on an error torch is iterating the hooks: removing one would mask the error
            for handle in handles:
                handle.remove()

    # always_call: the mode leaves the stack even when the forward raises (our refusal included).
    handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave, always_call=True)]
