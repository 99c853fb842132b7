"""Destroy the process group before the interpreter shuts down, on every backend."""

from __future__ import annotations

import atexit

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection

_registered = False


def destroy_process_group_at_exit() -> None:
    """Register Lightning's process-group teardown for gloo too, not only NCCL.

    Lightning registers it for NCCL alone. A gloo process group left alive at exit keeps its C++
    worker threads running while Python finalizes; under load a rank then aborts with
    "terminate called without an active exception" after a successful run, and torchrun reports the
    whole job as failed. Registering once per process is enough; the handler is a no-op when the
    group is already gone.

    Example::

        >>> destroy_process_group_at_exit()  # after init_process_group, in setup_environment
    """
    global _registered
    if _registered or not dist.is_initialized() or dist.get_backend() == "nccl":
        return
    atexit.register(_destroy_dist_connection)
    _registered = True
