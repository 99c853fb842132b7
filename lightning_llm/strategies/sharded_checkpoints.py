"""LLMParallelStrategy's checkpoints: sharded DCP saves and loads, async saves, strict loading.

Saves go through :mod:`lightning_llm.checkpointing.dcp` (one shard per rank, optimizer state keyed by
parameter name), or Lightning's full-state file with ``save_distributed_checkpoint=False``; both carry the
model's class and config for a Hugging Face export (:mod:`lightning_llm.hf.export_info`); a failed write
raises the same error on every rank. Loads take any Lightning checkpoint (one device, DDP, FSDPStrategy,
ModelParallelStrategy, DeepSpeed, this strategy's own) into any layout, strict both ways unless the module sets
``strict_loading=False``; a checkpoint committed by CheckpointRotation is verified against its checksums first.

:class:`ShardedCheckpoints` does the sharded part; the strategy's Lightning hooks call it and fall back to
Lightning's own full-file save.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from lightning_llm._compat.lightning import unwrap_optimizer
from lightning_llm.checkpointing import dcp as dcp_checkpoint
from lightning_llm.checkpointing import dcp_load
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.deepspeed_read import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from lightning_llm.checkpointing.errors import SAVE_ERRORS, SaveFailed, describe
from lightning_llm.checkpointing.full_load import load_full, read_full_file
from lightning_llm.checkpointing.optimizer_layout import from_named_groups
from lightning_llm.hf.export_info import EXPORT_KEY, describe_model
from lightning_llm.strategies.parallel_contract import AsyncSave

log = logging.getLogger(__name__)


class ShardedCheckpoints:
    """One strategy's checkpoint writer and reader; owns the :class:`~.dcp_checkpoint.AsyncSaver` of async saves.

    Arguments:
        distributed: the strategy's ``save_distributed_checkpoint``: one DCP shard per rank, else one full file
            that the strategy writes (and reads) with Lightning's own hooks.
    """

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.saver = dcp_checkpoint.AsyncSaver()

    def check_checkpoint_io(self, checkpoint_io: Any) -> None:
        """Say once that a CheckpointIO the user gave is not what writes sharded checkpoints (DCP does, one shard per
        rank, as under Lightning's ModelParallelStrategy); a full-file save (``save_distributed_checkpoint=False``)
        goes through it."""
        kind = type(checkpoint_io)
        if not self.distributed or kind is TorchCheckpointIO or kind.__module__.startswith("lightning_llm."):
            return
        rank_zero_warn(
            f"LLMParallelStrategy writes sharded checkpoints with torch.distributed.checkpoint, so your checkpoint_io "
            f"({kind.__name__}) is not used for saves, as under Lightning's ModelParallelStrategy. "
            "LLMParallelStrategy(save_distributed_checkpoint=False) writes one file through it; for asynchronous "
            "sharded saves use CheckpointRotation(async_save=True)."
        )

    def optimizer_state(self, model, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (see :mod:`lightning_llm.checkpointing.dcp`)."""
        return dcp_checkpoint.optimizer_state(model, optimizer)

    def full_optimizer_state(self, model, optimizer) -> dict[str, Any]:
        """The whole state on rank 0 (``{}`` elsewhere) in torch's layout, numbered as ``optimizer.state_dict()``
        numbers it (group by group), so a DDP or single-device run resumes it whatever its groups."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(model, unwrap_optimizer(optimizer), options=options)
        return from_named_groups(state) if state else {}

    def save(self, checkpoint: dict[str, Any], path: str, rank: int, storage_options: Any | None) -> bool:
        """Write ``checkpoint`` as DCP shards at ``path`` (in the background when ``storage_options`` is an
        :class:`AsyncSave`, which then holds the future); False where the caller writes a full file instead.

        One save at a time: a synchronous one first waits for an asynchronous one still writing.
        """
        if isinstance(storage_options, AsyncSave) and self.distributed:
            storage_options.future = self.saver.save(checkpoint, path, rank)
            return True
        self.saver.wait()
        if self.distributed:
            dcp_checkpoint.save(checkpoint, path, rank)
            return True
        return False

    def load(self, model, optimizers, path, strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """Load any Lightning checkpoint into this layout, whatever strategy and layout saved it; returns Lightning's
        other entries (loops, callbacks, schedulers).

        A sharded directory (this strategy's, ModelParallelStrategy's, FSDPStrategy's) through DCP, which reshards
        by name (:mod:`lightning_llm.checkpointing.dcp_load`); a DeepSpeed directory through DeepSpeed's own
        consolidation (:mod:`lightning_llm.checkpointing.deepspeed_read`); a single file (one device, DDP,
        FSDPStrategy's full files) read whole on every rank, each keeping its shards
        (:mod:`lightning_llm.checkpointing.full_load`).
        """
        if cfs.isfile(path):
            checkpoint = read_full_file(path, weights_only)
        elif is_deepspeed_checkpoint(cfs.local_path(path)):
            checkpoint = read_deepspeed_checkpoint(cfs.local_path(path), weights_only)
        else:
            return dcp_load.load(model, optimizers, path, strict, weights_only)
        load_full(model, optimizers, checkpoint, str(path), strict)
        checkpoint.pop("state_dict")  # loaded; Lightning's own loader hands on the rest the same way
        return checkpoint

    def wait(self) -> None:
        """Block until the last asynchronous checkpoint is fully written on this rank."""
        self.saver.wait()

    def finish(self) -> None:
        """Wait for a background save at teardown; raise its failure unless an error is already propagating.

        Lightning also tears down while an error propagates; a failed background save was already
        reported then (CheckpointRotation raised it), and must not replace that error.
        """
        handling = sys.exc_info()[1] is not None
        try:
            self.saver.wait()
        except SAVE_ERRORS as err:
            if not handling:
                raise SaveFailed("(asynchronous save)", describe(err, Path("."))) from err
            log.warning("An asynchronous checkpoint write failed (already reported): %s", err)


def add_export_info(checkpoint: dict[str, Any], module) -> None:
    """What `lightning-llm export --format hf` needs besides the tensors: the model's class, config and prefix."""
    entry = describe_model(module)
    if entry is not None:
        checkpoint.setdefault(EXPORT_KEY, entry)
