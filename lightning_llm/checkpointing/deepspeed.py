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


def saved_param_shapes(path: Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> full shape, as DeepSpeed recorded them in a checkpoint directory (None: not one it wrote)."""
    latest = Path(path) / "latest"
    if not latest.is_file():
        return None
    states = sorted((Path(path) / latest.read_text().strip()).glob("*model_states.pt"))
    if not states:
        return None
    groups = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True).get("param_shapes")
    if groups is None:
        return None
    groups = groups if isinstance(groups, list) else [groups]
    return {name: tuple(shape) for group in groups for name, shape in group.items()}
