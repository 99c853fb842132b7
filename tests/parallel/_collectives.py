"""Collectives run inside a region, with the elements each sends. torch's ``CommDebugMode`` counts the same ops, but
its module tracker raised ``IndexError`` on Hugging Face's experts forward (torch 2.13)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # bookkeeping ops of the functional collectives


class Collectives(TorchDispatchMode):
    """Records every collective op run inside it (c10d and functional collectives) and the elements it sends."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional") and func._opname not in NOT_COLLECTIVES:
            sent = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.calls.append((f"{namespace}.{func._opname}", sent.numel() if sent is not None else 0))
        return func(*args, **(kwargs or {}))


# FSDP2 reduce-scatters gradients through ``dist.reduce_scatter_single`` on torch 2.13 and
# ``dist.reduce_scatter_tensor`` on torch 2.11; it looks the function up on ``torch.distributed`` at each call.
REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


@contextlib.contextmanager
def counting_reduce_scatters() -> Iterator[dict[str, int]]:
    """Count FSDP2's gradient reduce-scatters inside the block (``calls["reduce_scatter"]``), on either torch."""
    import torch.distributed as dist

    calls = {"reduce_scatter": 0}
    originals = {name: getattr(dist, name) for name in REDUCE_SCATTERS if hasattr(dist, name)}

    def counting(original):
        def call(*args, **kwargs):
            calls["reduce_scatter"] += 1
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, counting(original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
