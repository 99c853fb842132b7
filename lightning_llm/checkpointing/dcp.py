"""Sharded checkpoints of LLMParallelStrategy with ``torch.distributed.checkpoint`` (DCP): save and async save
(loading, of these and of Lightning's other sharded checkpoints: :mod:`.dcp_load`).

Optimizer state is saved in torch's "flattened" form, keyed by parameter name: Lightning's form keys
parameter groups by index, and pipeline stages have different groups under the same index, so a
sharded checkpoint could not tell them apart. Loading reshards by name, so the layout (tp, pp, ZeRO
degree, world size) may differ between save and load. Checkpoints go to any fsspec location: local
directories through DCP's file writer and reader, URLs of other filesystems through its fsspec ones
(:func:`lightning_llm.checkpointing.fs.storage_writer`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from lightning_llm._compat.lightning import METADATA_FILENAME, unwrap_optimizer
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.checksums import refusal
from lightning_llm.checkpointing.fs import Location
from lightning_llm.checkpointing.staging import HostCopy, reusable_stager
from lightning_llm.checkpointing.write_gate import BACKGROUND_WRITES, background_writer, resume_background_writes

FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter name (hyperparameters included), this rank's shards."""
    optimizer = unwrap_optimizer(optimizer)  # Lightning's LightningOptimizer wraps the real one
    return get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER)


class AsyncSaver:
    """Writes sharded checkpoints in the background, one at a time; training waits only for the host copy.

    Every tensor is copied to host buffers reused from save to save (:mod:`.staging`), then
    written by a background thread whose collectives run on a gloo group of their own, so they cannot
    interleave with the training's collectives; :meth:`save` waits for the previous write before it
    overwrites the buffers. Rank 0 also writes the rest of Lightning's dict (loops, callbacks,
    hyper-parameters) to ``meta.pt`` after its shards; the returned future resolves after both.

    - On CPU the copy is :class:`HostCopy` (torch's stager spends ~5x the copy in Python per tensor
      there), and the whole write, DCP's planning included, waits behind :data:`BACKGROUND_WRITES`
      until training has resumed (:mod:`.write_gate`).
    - On CUDA the copy is DCP's ``async_save`` with torch's stager (pinned host buffers for the
      device-to-host copy, which dominates there).
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._future: Future | None = None
        self._cuda = torch.cuda.is_available()
        self._stager = reusable_stager() if self._cuda else None
        self._shard_copy, self._rest_copy = HostCopy(), HostCopy()

    def save(self, checkpoint: dict[str, Any], path: Location, global_rank: int) -> Future:
        """Start writing ``checkpoint`` (Lightning's dict, with ``state_dict`` and ``optimizer_states``) to ``path``."""
        self.wait()
        state = _split(checkpoint, path)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        writer = cfs.storage_writer(path)
        if self._cuda:
            shards = dcp.async_save(state, storage_writer=writer, process_group=self._group, async_stager=self._stager)
        else:
            shards = partial(dcp.save, self._shard_copy(state), storage_writer=writer, process_group=self._group)
        rest = self._rest_copy(checkpoint) if global_rank == 0 else None
        BACKGROUND_WRITES.hold()
        self._future = background_writer().submit(_finish, shards, rest, path)
        return self._future

    def wait(self) -> None:
        """Block until the last save is fully written on this rank."""
        if self._future is not None:
            future, self._future = self._future, None
            resume_background_writes()
            future.result()


def _finish(shards: Callable[[], Any] | Future, rest: dict[str, Any] | None, path: Location) -> Any:
    """The background part of a save: wait for training to resume, write (or wait for) the shards, then (rank 0)
    ``meta.pt``."""
    BACKGROUND_WRITES.wait()
    result = shards() if callable(shards) else shards.result()
    if rest is not None:
        cfs.torch_save(rest, cfs.join(path, METADATA_FILENAME))
    return result


def save(checkpoint: dict[str, Any], path: Location, global_rank: int) -> None:
    """Write ``checkpoint`` (Lightning's dict) to the directory ``path`` now: shards by DCP, the rest in ``meta.pt``
    (Lightning's layout, which its ``ModelParallelStrategy`` writes to local paths only)."""
    dcp.save(_split(checkpoint, path), storage_writer=cfs.storage_writer(path))
    if global_rank == 0:
        cfs.torch_save(checkpoint, cfs.join(path, METADATA_FILENAME))


def _split(checkpoint: dict[str, Any], path: Location) -> dict[str, Any]:
    # DCP writes the tensors; what is left in `checkpoint` (loops, callbacks, hyperparameters) goes to meta.pt.
    cfs.makedirs(path)
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return state


def refuse_unverified(strategy, path: Location) -> None:
    """Raise ``ValueError`` on every rank if a committed checkpoint's content fails its checksums (rank 0 reads it)."""
    error = strategy.broadcast(refusal(path) if strategy.global_rank == 0 else None)
    if error is not None:
        raise ValueError(error)
