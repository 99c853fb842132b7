"""The memory of the device a rank trains on."""

from __future__ import annotations

import torch


def total_device_memory(device: torch.device) -> int:
    """Total memory of the accelerator, or of the host for CPU training."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    import psutil

    return psutil.virtual_memory().total
