"""Which linear layers' outputs a forward cuts into parts along their last dimension, read while the forward runs.

A column split of a linear gives each rank a contiguous block of the output's columns. When the model then cuts
that output into parts (ModernBERT's ``input, gate = Wi(x).chunk(2, dim=-1)``, a ``split([q, k, v], -1)``), each
rank needs its share of every part instead (tensor parallelism's ``fused_colwise``). The parts are seen, not named:
each output is followed through element-wise ops (an activation, a clamp) to a ``split``/``chunk`` of its last
dimension; any other consumer (a view into heads, a matmul) ends the follow without a cut. Each part is followed on
the same way, for two more facts the split needs (PaLM's ``q, k, v, ff = fused_attn_ff_proj(x).split(...)``):

* a part cut again (``ff``'s ``x, gate = ff.chunk(2, dim=-1)``) is recorded as its sub-parts, each split per rank;
* where one part is viewed into heads (``(..., heads, head_dim)``, the widest such part), a part exactly one head
  wide that is not (multi-query attention's single ``k`` and ``v``) is shared whole by every rank: ``"*8"``.

:func:`~lightning_llm.modeling.structure.trace_calls` runs this beside its call recording, so the structure the
strategy reads once holds the cuts too (:attr:`~lightning_llm.modeling.structure.Call.cut`).

Example::

    with OutputCuts() as cuts:
        cuts.watch(0, model.mlp.Wi(x))   # what a forward hook does for each linear call
        ...                              # the model cuts it: a, b = out.chunk(2, dim=-1)
    cuts.parts(0)                        # (64, 64)
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

CUTS = {torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.Tensor.split_with_sizes}
VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten, torch.unflatten}

Part = int | str  # a part's width, split per rank; "*N": N wide, whole on every rank


class OutputCuts(TorchFunctionMode):
    """Records, per watched call, the widths its output was cut into along the last dimension (:meth:`parts`)."""

    def __init__(self) -> None:
        super().__init__()
        # id(tensor) -> (the tensor, the call it came from, the part of its cut it is, or None for the whole output)
        self.tracked: dict[int, tuple[weakref.ref, int, int | None]] = {}
        self.found: dict[int, tuple[int, ...]] = {}
        self.recut: dict[tuple[int, int], tuple[int, ...]] = {}  # (call, part) -> the part's own cut
        self.views: dict[tuple[int, int], tuple[int, int]] = {}  # (call, part) -> (heads, head width) it was viewed as

    def watch(self, call: int, output: object) -> None:
        """Follow ``output`` (a linear's output, from call ``call``) to what consumes it."""
        self._track(output, call, None)

    def parts(self, call: int) -> tuple[Part, ...]:
        """The parts call ``call``'s output was cut into (empty when it was not): a part cut again gives its
        sub-parts; a part one head wide beside a part viewed into heads is ``"*N"`` (see the module docstring)."""
        sizes = self.found.get(call, ())
        viewed = [(sizes[part], part, view) for (c, part), view in self.views.items() if c == call and view[0] > 1]
        _, heads_part, (_, head_width) = max(viewed) if viewed else (0, None, (0, None))
        parts: list[Part] = []
        for index, size in enumerate(sizes):
            if size == head_width and index != heads_part:  # its own cut (rotary's halves) is inside the head
                parts.append(f"*{size}")
            elif (call, index) in self.recut:
                parts += self.recut[call, index]
            else:
                parts.append(size)
        return tuple(parts)

    def _track(self, value: object, call: int, part: int | None) -> None:
        if isinstance(value, torch.Tensor):
            self.tracked[id(value)] = (weakref.ref(value), call, part)

    def _source(self, value: object) -> tuple[int, int | None] | None:
        ref, call, part = self.tracked.get(id(value), (None, None, None))
        return (call, part) if ref is not None and ref() is value else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.tracked or getattr(func, "__name__", "") == "__get__":  # .shape, .dtype: not a use
            return result
        sources = [(a, source) for a in args if (source := self._source(a)) is not None]
        if not sources:
            return result
        x, (call, part) = sources[0]
        if func in CUTS and x is args[0]:
            self._cut(call, part, cut_sizes(args, kwargs, x, result), result)
        elif func in VIEWS and part is not None and isinstance(result, torch.Tensor):
            if result.dim() == x.dim() + 1 and result.shape[:-2] == x.shape[:-1]:
                self.views.setdefault((call, part), tuple(result.shape[-2:]))
        elif isinstance(result, torch.Tensor) and result.shape == x.shape and func not in VIEWS:
            self._track(result, call, part)  # element-wise: follow the output on
        return result

    def _cut(self, call: int, part: int | None, sizes: tuple[int, ...] | None, result) -> None:
        if not sizes:
            return
        if part is None and call not in self.found:
            self.found[call] = sizes
            for index, piece in enumerate(result):
                self._track(piece, call, index)
        elif part is not None:
            self.recut.setdefault((call, part), sizes)


def cut_sizes(args: tuple, kwargs: dict, x: torch.Tensor, result: object) -> tuple[int, ...] | None:
    """The widths of a cut of ``x``'s last dimension into several parts covering it, else ``None``."""
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if not isinstance(dim, int) or not x.dim() or dim % x.dim() != x.dim() - 1:
        return None
    sizes = tuple(part.shape[-1] for part in result)
    return sizes if len(sizes) > 1 and sum(sizes) == x.shape[-1] else None
