"""Collectives run inside a region, with the elements each sends. torch's ``CommDebugMode`` counts the same ops, but
its module tracker raised ``IndexError`` on Hugging Face's experts forward (torch 2.13)."""

from __future__ import annotations

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
