"""LLMDeepSpeedStrategy's checkpoint hooks: DeepSpeed's own save and load, made safe for committed checkpoints.

A write that fails on any rank raises the same error on every rank; a load is verified against its commit marker,
refused when DeepSpeed's full unpickler would import more than its own classes, and its parameter names and shapes
compared both ways first. With them, the contract's checkpoint members (:class:`DeepSpeedCheckpointHooksMixin`):
DeepSpeed writes its directory synchronously, on every rank, with local file APIs.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy
from typing_extensions import override

from lightning_llm.checkpointing.dcp import refuse_unverified
from lightning_llm.checkpointing.deepspeed import KeepWriteErrors, saved_param_shapes, unsafe_pickle_refusal
from lightning_llm.checkpointing.errors import save_on_every_rank
from lightning_llm.checkpointing.keys import matching_keys
from lightning_llm.contract import completed
from lightning_llm.modeling.tied import refuse_untied_names, tied_parameter_names


class DeepSpeedCheckpointHooksMixin(DeepSpeedStrategy):
    """The checkpoint hooks of :class:`~lightning_llm.strategies.LLMDeepSpeedStrategy` (a base of it, not a strategy
    of its own)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """DeepSpeed's save; a write that fails on any rank raises the same ``SaveFailed`` on every rank
        (see :class:`lightning_llm.checkpointing.deepspeed.KeepWriteErrors`)."""
        engine = self.deepspeed_engine
        guard = engine.checkpoint_engine = KeepWriteErrors(engine.checkpoint_engine)
        deepspeed_save = super().save_checkpoint

        def save() -> None:
            deepspeed_save(checkpoint, filepath, storage_options)
            if guard.error is not None:
                raise guard.error

        try:
            save_on_every_rank(save, filepath)
        finally:
            engine.checkpoint_engine = guard.inner

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """DeepSpeed's load, after the content check of a committed checkpoint, a scan for anything DeepSpeed's full
        unpickler would import beyond its own classes (unless ``weights_only=False``: the user trusts the files),
        and a strict two-way comparison of parameter names and shapes (DeepSpeed compares only the model's names)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        refuse_unverified(self, path)
        trusted = weights_only is False  # trainer.fit(..., weights_only=False): the user vouches for the files
        error = None if trusted else self.broadcast(unsafe_pickle_refusal(path) if self.global_rank == 0 else None)
        if error is not None:
            raise ValueError(error)
        saved = saved_param_shapes(path, weights_only=not trusted)
        if saved is not None:
            refuse_untied_names(tied_parameter_names(self.model.module), saved, str(path))  # names tell: one each
            model = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in self.model.module.named_parameters()}
            matching_keys(model, saved, self.lightning_module.strict_loading, str(path))
        return super().load_checkpoint(checkpoint_path, weights_only)

    # The contract's checkpoint members (documented in lightning_llm.contract.protocol).

    @property
    def supports_async_save(self) -> bool:
        return False

    @property
    def saves_through_checkpoint_io(self) -> bool:
        """False: DeepSpeed's engine writes its checkpoint directory on every rank."""
        return False

    @property
    def loads_through_checkpoint_io(self) -> bool:
        """False: DeepSpeed's engine loads its checkpoint directory (verified first by ``load_checkpoint``)."""
        return False

    @property
    def saves_to_urls(self) -> bool:
        """False: DeepSpeed writes with local file APIs."""
        return False

    def save_checkpoint_async(self, filepath, weights_only: bool = False) -> Future:
        """DeepSpeed writes its checkpoints synchronously: saves, then returns a completed future."""
        self.lightning_module.trainer.save_checkpoint(filepath, weights_only=weights_only)
        return completed()
