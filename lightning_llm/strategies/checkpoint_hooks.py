"""The checkpoint hooks of LLMParallelStrategy (a mixin): sharded DCP saves and loads, async saves, strict loading.

Saves go through :mod:`lightning_llm.checkpointing.dcp` (one shard per rank, optimizer state keyed by
parameter name), or Lightning's full-state file with ``save_distributed_checkpoint=False``; both carry the
model's class and config for a Hugging Face export (:mod:`lightning_llm.hf.export_info`); a failed write
raises the same error on every rank. Loads are strict both ways unless the module sets ``strict_loading=False``,
and a checkpoint committed by CheckpointRotation is verified against its checksums first.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_llm._compat.lightning import saves_distributed_checkpoint
from lightning_llm.checkpointing import dcp as dcp_checkpoint
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.errors import SAVE_ERRORS, SaveFailed, describe, save_on_every_rank
from lightning_llm.checkpointing.files import checkpoint_of
from lightning_llm.checkpointing.keys import matching_keys
from lightning_llm.hf.export_info import EXPORT_KEY, describe_model
from lightning_llm.strategies.parallel_contract import AsyncSave

log = logging.getLogger(__name__)


class ShardedCheckpointHooks:
    """Lightning's checkpoint hooks for a strategy holding ``self._saver`` (a :class:`~.dcp_checkpoint.AsyncSaver`)."""

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (see :mod:`lightning_llm.checkpointing.dcp`)."""
        if not saves_distributed_checkpoint(self):
            return super().optimizer_state(optimizer)
        return dcp_checkpoint.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        # What `lightning-llm export --format hf` needs besides the tensors: the model's class, config and prefix.
        entry = describe_model(self.lightning_module)
        if entry is not None:
            checkpoint.setdefault(EXPORT_KEY, entry)
        # A failed write raises the same SaveFailed on every rank, so no rank is left waiting in a collective.
        save_on_every_rank(lambda: self._save_checkpoint(checkpoint, filepath, storage_options), filepath)

    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None) -> None:
        path = self.broadcast(str(filepath))  # a local path or an fsspec URL, the same on every rank
        if isinstance(storage_options, AsyncSave):
            if saves_distributed_checkpoint(self):
                storage_options.future = self._saver.save(checkpoint, path, self.global_rank)
                return
            storage_options = None
        self._saver.wait()  # one save at a time: an asynchronous one still writing finishes first
        if saves_distributed_checkpoint(self):
            dcp_checkpoint.save(checkpoint, path, self.global_rank)
            return
        super().save_checkpoint(checkpoint, cfs.local_path(path), storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint this strategy saved into this layout, whatever layout saved it (DCP reshards by name).

        A full single file (``save_distributed_checkpoint=False``) goes through Lightning's loader. Both are
        strict both ways unless ``strict_loading=False``, and a checkpoint committed by CheckpointRotation is
        first checked against its checksums (:mod:`lightning_llm.checkpointing.dcp`).
        """
        self._saver.wait()
        # A local path or an fsspec URL; a marker stands for its checkpoint where Lightning could not pick a directory
        # by time for ckpt_path="last" (lightning_llm.checkpointing.commit.last_candidate).
        path = checkpoint_of(self.broadcast(str(checkpoint_path)))
        dcp_checkpoint.refuse_unverified(self, path)
        strict = self.lightning_module.strict_loading
        if cfs.isfile(path):
            if strict:
                matching_keys(dcp_checkpoint.model_shapes(self.model), dcp_checkpoint.file_shapes(path), strict, path)
            return super().load_checkpoint(cfs.local_path(path), weights_only=weights_only)
        return dcp_checkpoint.load(self.model, self.optimizers, path, strict, weights_only)

    def wait_for_checkpoint(self) -> None:
        """Block until the last asynchronous checkpoint is fully written on this rank."""
        self._saver.wait()

    @override
    def teardown(self) -> None:
        # Lightning also tears down while an error propagates; a failed background save was already
        # reported then (CheckpointRotation raised it), and must not replace that error.
        handling = sys.exc_info()[1] is not None
        try:
            self._saver.wait()
        except SAVE_ERRORS as err:
            if not handling:
                raise SaveFailed("(asynchronous save)", describe(err, Path("."))) from err
            log.warning("An asynchronous checkpoint write failed (already reported): %s", err)
        finally:
            super().teardown()
