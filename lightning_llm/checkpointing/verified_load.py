"""VerifiedLoad: the checks a checkpoint passes before Lightning's single-file strategies load it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.checkpointing import checksums
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.keys import matching_keys
from lightning_llm.modeling.tied import differing, refuse_untied, tied_groups


class VerifiedLoad(CheckpointIO):
    """Stands in for a strategy's CheckpointIO: refuses a committed checkpoint whose content no longer matches the
    checksums in its marker, one saved untied for a model that ties those weights, and compares its ``state_dict``
    with the model's both ways (names and shapes), with ``strict_loading=False`` loading only the tensors that
    match. The strategies of this package check in their
    own loaders; this covers Lightning's single-file ones (single device, DDP).

    Example::

        strategy.checkpoint_io = VerifiedLoad(strategy.checkpoint_io, strategy)
    """

    def __init__(self, inner: CheckpointIO, strategy: Any, verified: Callable[[], str | None] = lambda: None) -> None:
        # `verified()`: a checkpoint this process checked moments ago (ckpt_path="last"), not read twice.
        self.inner, self.strategy, self.verified = inner, strategy, verified

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        if cfs.isdir(path):  # torch.load would fail with a bare IsADirectoryError
            raise ValueError(
                f"ckpt_path={str(path)!r} is a directory (a sharded checkpoint of LLMParallelStrategy or DeepSpeed), "
                f"but {type(self.strategy).__name__} loads single-file checkpoints. Resume with the strategy that "
                f"saved it, or consolidate it first: python -m lightning_llm.checkpointing.consolidate {path} out.ckpt"
            )
        if str(path) != self.verified() and (error := checksums.refusal(path)) is not None:
            raise ValueError(error)
        checkpoint = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        module = self.strategy.lightning_module
        if module is not None and isinstance(checkpoint.get("state_dict"), dict):
            refuse_untied(differing(tied_groups(module.state_dict()), checkpoint["state_dict"]), str(path))
            keep = matching_keys(
                _shapes(module.state_dict()), _shapes(checkpoint["state_dict"]), module.strict_loading, str(path)
            )
            if len(keep) < len(checkpoint["state_dict"]) or set(keep) != set(module.state_dict()):
                checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
                # Optimizer states are keyed by parameter position, which no longer lines up: start them afresh
                # (an empty list restores none) rather than fail, or worse, pair moments with the wrong tensors.
                checkpoint["optimizer_states"] = []
                rank_zero_warn(
                    f"strict_loading=False: the optimizer state in {path} is not restored (the "
                    "parameters differ from the checkpoint's)."
                )
        return checkpoint

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _shapes(state: dict) -> dict[str, tuple[int, ...] | None]:
    return {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in state.items()}
