"""Destroy the process group before the interpreter shuts down, on every backend."""

from __future__ import annotations

import atexit
import gc

import torch.distributed as dist

from lightning_llm._compat.lightning import destroy_dist_connection

_registered = False


def destroy_process_group_at_exit() -> None:
    """Tear gloo process groups down at exit while Python is still whole (Lightning does it for NCCL only).

    A gloo process group that outlives ``atexit`` is freed by the interpreter's final garbage
    collection, when its worker threads can no longer take the GIL: a rank then aborts with
    "terminate called without an active exception" after a successful run, and torchrun reports the
    job as failed (measured on a 2-rank tp run: 2 of 4 runs aborted, 0 of 10 with this handler).
    The handler destroys the groups and collects the cycles still holding them (modules, hooks and
    DTensors referencing the mesh), so the threads are joined before finalization starts.

    Example::

        >>> destroy_process_group_at_exit()  # after init_process_group, in setup_environment
    """
    global _registered
    if _registered or not dist.is_initialized() or dist.get_backend() == "nccl":
        return
    atexit.register(_destroy_and_collect)
    _registered = True


def _destroy_and_collect() -> None:
    destroy_dist_connection()
    gc.collect()
