"""Sharded checkpoints of LLMParallelStrategy with ``torch.distributed.checkpoint`` (DCP): save, async save, load.

Optimizer state is saved in torch's "flattened" form, keyed by parameter name: Lightning's form keys
parameter groups by index, and pipeline stages have different groups under the same index, so a
sharded checkpoint could not tell them apart. Loading reshards by name, so the layout (tp, pp, ZeRO
degree, world size) may differ between save and load.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter name (hyperparameters included), this rank's shards."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer wraps the real one
    return get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER)


class AsyncSaver:
    """Writes sharded checkpoints in the background with DCP's ``async_save``, one at a time.

    ``async_save`` copies the state to host memory before returning; the files are written by a
    background thread whose collectives run on a gloo group of their own, so they cannot interleave
    with the training's collectives.
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._future: Future | None = None

    def save(self, checkpoint: dict[str, Any], path: Path, global_rank: int) -> Future:
        """Start writing ``checkpoint`` (Lightning's dict, with ``state_dict`` and ``optimizer_states``) to ``path``."""
        self.wait()
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        self._future = dcp.async_save(state, checkpoint_id=path, process_group=self._group)
        if global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)  # the rest: loops, callbacks, hyperparameters
        return self._future

    def wait(self) -> None:
        """Block until the last save is fully written on this rank."""
        if self._future is not None:
            future, self._future = self._future, None
            future.result()


def load(model: nn.Module, optimizers: list, path: Path, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` and ``optimizers`` (whatever layout saved it); returns the rest."""
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"{path} is not a sharded checkpoint directory (no .metadata inside). LLMParallelStrategy resumes "
            "from checkpoints it saved; load a single-file checkpoint into the model before fitting instead."
        )
    model_state = {"state_dict": get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=path)
    set_model_state_dict(model, model_state["state_dict"], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        state = {key: optimizer_state(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, getattr(optimizer, "_optimizer", optimizer), state[key], options=FLAT_OPTIMIZER)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
