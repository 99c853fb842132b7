"""Which linear layers' outputs a forward cuts into parts along their last dimension, read while the forward runs.

A column split of a linear gives each rank a contiguous block of the output's columns. When the model then cuts
that output into parts (ModernBERT's ``input, gate = Wi(x).chunk(2, dim=-1)``, a ``split([q, k, v], -1)``), each
rank needs its share of every part instead (tensor parallelism's ``fused_colwise``). The parts are seen, not named:
each output is followed through element-wise ops (an activation, a clamp) to a ``split``/``chunk`` of its last
dimension; any other consumer (a view into heads, a matmul) ends the follow without a cut.

:func:`~lightning_llm.modeling.structure.trace_calls` runs this beside its call recording, so the structure the
strategy reads once holds the cuts too (:attr:`~lightning_llm.modeling.structure.Call.cut`).

Example::

    with OutputCuts() as cuts:
        cuts.watch(0, model.mlp.Wi(x))   # what a forward hook does for each linear call
        ...                              # the model cuts it: a, b = out.chunk(2, dim=-1)
    cuts.found                           # {0: (64, 64)}
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

CUTS = {torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.Tensor.split_with_sizes}
VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten, torch.unflatten}


class OutputCuts(TorchFunctionMode):
    """Records, per watched call, the widths its output was cut into along the last dimension (``found``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (the tensor, the call it came from)
        self.found: dict[int, tuple[int, ...]] = {}

    def watch(self, call: int, output: object) -> None:
        """Follow ``output`` (a linear's output, from call ``call``) to what consumes it."""
        if isinstance(output, torch.Tensor):
            self.tracked[id(output)] = (weakref.ref(output), call)

    def _call_of(self, value: object) -> int | None:
        ref, call = self.tracked.get(id(value), (None, None))
        return call if ref is not None and ref() is value else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.tracked or getattr(func, "__name__", "") == "__get__":  # .shape, .dtype: not a use
            return result
        calls = [(a, call) for a in args if (call := self._call_of(a)) is not None]
        if not calls:
            return result
        x, call = calls[0]
        if func in CUTS and x is args[0]:
            sizes = cut_sizes(args, kwargs, x, result)
            if sizes and call not in self.found:
                self.found[call] = sizes
        elif isinstance(result, torch.Tensor) and result.shape == x.shape and func not in VIEWS:
            self.tracked[id(result)] = (weakref.ref(result), call)  # element-wise: follow the output on
        return result


def cut_sizes(args: tuple, kwargs: dict, x: torch.Tensor, result: object) -> tuple[int, ...] | None:
    """The widths of a cut of ``x``'s last dimension into several parts covering it, else ``None``."""
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if not isinstance(dim, int) or not x.dim() or dim % x.dim() != x.dim() - 1:
        return None
    sizes = tuple(part.shape[-1] for part in result)
    return sizes if len(sizes) > 1 and sum(sizes) == x.shape[-1] else None
