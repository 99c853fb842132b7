"""The memory of the device a rank trains on, and the smallest over the job's ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist


def total_device_memory(device: torch.device) -> int:
    """Total memory of the accelerator, or of the host for CPU training."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    import psutil

    return psutil.virtual_memory().total


def min_over_ranks(value: int, group=None) -> int:
    """The smallest ``value`` over the ranks of ``group`` (``value`` itself without a process group).

    Plans made from it (``zero_stage="auto"``) come out the same on every rank.

    Example::

        memory = min_over_ranks(total_device_memory(device))
    """
    if not dist.is_initialized():
        return value
    backend = str(dist.get_backend(group))
    on_gpu = "gloo" not in backend and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())
