"""LLMDeepSpeedStrategy's checkpoint safety: save failures shared by every rank, strict and verified loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_llm.checkpointing.errors import SAVE_ERRORS


class KeepWriteErrors:
    """Stands in for a DeepSpeed engine's ``checkpoint_engine`` for one save: keeps the first failed write.

    DeepSpeed writes every checkpoint file through its engine's pluggable ``checkpoint_engine``, between
    barriers: a write that raised would leave its rank outside a barrier the others wait in. Keeping the
    error (and skipping this rank's later writes, the save is lost anyway) lets all ranks finish the save
    and then share the failure. Everything else is the wrapped engine's.

    Example::

        engine.checkpoint_engine = guard = KeepWriteErrors(engine.checkpoint_engine)
    """

    def __init__(self, inner: Any) -> None:
        self.inner, self.error = inner, None

    def save(self, state_dict: dict, path: str) -> None:
        if self.error is not None:
            return
        try:
            self.inner.save(state_dict, path)
        except SAVE_ERRORS as err:
            self.error = err

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
"""The classes DeepSpeed itself pickles into its optimizer-state files (plain classes, an Enum and a dataclass:
rebuilding them runs no code), on top of what torch's weights-only unpickler allows."""


def unsafe_pickle_refusal(path: Path) -> str | None:
    """A refusal naming the first ``.pt`` file under a DeepSpeed checkpoint that would import anything beyond
    torch's weights-only set and :data:`DEEPSPEED_GLOBALS`, or None.

    DeepSpeed loads its files with a full unpickler (``weights_only=False``), which imports and calls whatever a
    crafted file names; torch's ``get_unsafe_globals_in_checkpoint`` lists those names without unpickling, so this
    scan runs before DeepSpeed opens anything.
    """
    for file in sorted(Path(path).rglob("*.pt")):
        unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(file)) - DEEPSPEED_GLOBALS)
        if unsafe:
            return (
                f"{file} would import {unsafe} when unpickled: DeepSpeed loads checkpoint files with a full "
                "unpickler, which runs what a crafted file names, so the checkpoint is refused. If you trust it, "
                "resume with `trainer.fit(..., ckpt_path=..., weights_only=False)`."
            )
    return None


def saved_param_shapes(path: Path, weights_only: bool = True) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> full shape, as DeepSpeed recorded them in a checkpoint directory (None: not one it wrote);
    the model-states file is read weights-only unless the caller trusts the checkpoint."""
    latest = Path(path) / "latest"
    if not latest.is_file():
        return None
    states = sorted((Path(path) / latest.read_text().strip()).glob("*model_states.pt"))
    if not states:
        return None
    groups = torch.load(states[0], map_location="cpu", weights_only=weights_only, mmap=True).get("param_shapes")
    if groups is None:
        return None
    groups = groups if isinstance(groups, list) else [groups]
    return {name: tuple(shape) for group in groups for name, shape in group.items()}
