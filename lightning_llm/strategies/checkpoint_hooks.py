"""LLMParallelStrategy's checkpoint hooks: saves as sharded DCP through its ``ShardedCheckpoints`` or the parent's
full file; loads of any Lightning checkpoint through ``ShardedCheckpoints``.

Lightning's save, load and optimizer-state hooks, and the contract's checkpoint members, as one part of the
strategy (:class:`CheckpointHooksMixin`); what a sharded save or load does is in
:class:`~lightning_llm.strategies.sharded_checkpoints.ShardedCheckpoints`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.dcp import refuse_unverified
from lightning_llm.checkpointing.errors import save_on_every_rank
from lightning_llm.checkpointing.files import checkpoint_of
from lightning_llm.strategies import parallel_contract as contract
from lightning_llm.strategies.parallel_contract import AsyncSave
from lightning_llm.strategies.sharded_checkpoints import ShardedCheckpoints, add_export_info


class CheckpointHooksMixin(ModelParallelStrategy):
    """The checkpoint hooks of :class:`~lightning_llm.strategies.LLMParallelStrategy` (a base of it, not a strategy
    of its own): saves and loads through ``self.checkpoints``, which the strategy's ``__init__`` sets."""

    checkpoints: ShardedCheckpoints

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (see :mod:`lightning_llm.checkpointing.dcp`)."""
        if not self.checkpoints.distributed:
            return self.checkpoints.full_optimizer_state(self.model, optimizer)
        return self.checkpoints.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Lightning's ``ModelParallelStrategy`` rules: ``storage_options`` refused (TypeError), a sharded save over
        a file replaces it; a failed write raises the same error on every rank, also an instance of the
        original built-in type (``IsADirectoryError`` for a full-file save onto a directory)."""
        if storage_options is not None and not isinstance(storage_options, AsyncSave):
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported because "
                f"`{type(self).__name__}` writes through torch.distributed.checkpoint, not a CheckpointIO (as "
                "Lightning's ModelParallelStrategy); give fsspec options through the URL or the environment."
            )
        if self.lightning_module is not None:
            add_export_info(checkpoint, self.lightning_module)
        # A failed write raises the same SaveFailed on every rank, so no rank is left waiting in a collective.
        save_on_every_rank(lambda: self._write_checkpoint(checkpoint, filepath, storage_options), filepath)

    def _write_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None) -> None:
        path = self.broadcast(str(filepath))  # a local path or an fsspec URL, the same on every rank
        if self.checkpoints.distributed:  # a sharded save over a file replaces it, as Lightning's does
            if self.global_rank == 0 and cfs.isfile(path):
                cfs.remove_tree(path)
            self.barrier()
        if not self.checkpoints.save(checkpoint, path, self.global_rank, storage_options):
            storage_options = None if isinstance(storage_options, AsyncSave) else storage_options
            super().save_checkpoint(checkpoint, cfs.local_path(path), storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load into this layout, whatever strategy and layout saved it; strict unless ``strict_loading=False``;
        verified first.

        Also inside ``torch.inference_mode()`` (``trainer.test(ckpt_path=...)`` there): FSDP2's state-dict hooks
        cannot run on inference tensors, so the load runs outside it."""
        with torch.inference_mode(False):
            return self._load_checkpoint(checkpoint_path, weights_only)

    def _load_checkpoint(self, checkpoint_path, weights_only: bool | None) -> dict[str, Any]:
        self.checkpoints.wait()
        # A local path or an fsspec URL; a marker stands for its checkpoint where Lightning could not pick a directory
        # by time for ckpt_path="last" (lightning_llm.checkpointing.commit.last_candidate).
        path = checkpoint_of(self.broadcast(str(checkpoint_path)))
        refuse_unverified(self, path)
        trainer, strict = self.lightning_module._trainer, self.lightning_module.strict_loading
        # Optimizer state only to fit, as Lightning's connector restores it: a test after fit still holds them.
        optimizers = self.optimizers if trainer is None or trainer.state.fn == TrainerFn.FITTING else []
        # Any Lightning checkpoint: a file, a sharded or a DeepSpeed directory (ShardedCheckpoints.load says how).
        return self.checkpoints.load(self.model, optimizers, path, strict, weights_only)

    def wait_for_checkpoint(self) -> None:
        """Block until the last asynchronous checkpoint is fully written on this rank."""
        self.checkpoints.wait()

    @override
    def teardown(self) -> None:
        try:
            self.checkpoints.finish()
        finally:
            super().teardown()

    # The contract's checkpoint members (documented in lightning_llm.contract.protocol). Saves and loads go through
    # save_checkpoint / load_checkpoint above (a failed write raises on every rank; loads verify committed
    # checkpoints).

    @property
    def supports_async_save(self) -> bool:
        return self.checkpoints.distributed

    @property
    def saves_to_urls(self) -> bool:
        """Whether checkpoints are DCP directories (torch's fsspec writer, so any URL) rather than one local file."""
        return self.checkpoints.distributed

    saves_through_checkpoint_io = property(lambda self: False)
    loads_through_checkpoint_io = property(lambda self: False)

    def save_checkpoint_async(self, filepath, weights_only: bool = False) -> Future:
        """Save with DCP's ``async_save`` (synchronous, future already done, with ``save_distributed_checkpoint=False``)."""
        return contract.save_checkpoint_async(self.lightning_module.trainer, filepath, weights_only)
