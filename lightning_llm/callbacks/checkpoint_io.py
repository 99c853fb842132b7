"""Pieces of CheckpointRotation that talk to Lightning's strategy: a staged background write and the layout record."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.io import CheckpointIO


class StagedWrite(CheckpointIO):
    """Stands in for a strategy's CheckpointIO for one save: copies the tensors now, writes them on ``executor``.

    Lightning's ``AsyncCheckpointIO`` copies and writes in a thread too, but reports no completion of
    a particular save, and the commit marker must be written only after the file is. Here the write
    and ``then`` (the commit) run as one task whose :class:`Future` is kept in ``future``.

    Arguments:
        inner: the CheckpointIO that writes (the strategy's own).
        executor: where the write runs (one worker keeps saves in order).
        then: called in the same task once the file is written.
    """

    def __init__(self, inner: CheckpointIO, executor: Executor, then: Callable[[], None]) -> None:
        self.inner, self.executor, self.then = inner, executor, then
        self.future: Future | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        # The only stall: a point-in-time host copy, so training may change the live tensors meanwhile.
        staged = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))

        def write_and_commit() -> None:
            self.inner.save_checkpoint(staged, path, storage_options=storage_options)
            self.then()

        self.future = self.executor.submit(write_and_commit)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)


def checkpoint_layout(trainer: L.Trainer) -> dict[str, Any]:
    """How the saving job was laid out: strategy, world size, tp/pp/dp degrees and ZeRO stage."""
    strategy = trainer.strategy
    layout: dict[str, Any] = {"strategy": type(strategy).__name__, "world_size": trainer.world_size,
                              "num_nodes": trainer.num_nodes}
    dims = getattr(strategy, "parallel_dims", None)
    if dims is not None:
        layout.update(tp=dims.tp, pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard)
    else:
        layout.update(tp=1, pp=1, dp_replicate=trainer.world_size, dp_shard=1)
    zero = getattr(strategy, "zero_stage", None)
    if zero is None and isinstance(getattr(strategy, "config", None), dict):  # Lightning's DeepSpeedStrategy
        zero = strategy.config.get("zero_optimization", {}).get("stage")
    layout["zero_stage"] = zero
    return layout


def rng_state() -> dict[str, Any]:
    """This process's random generators (Python, NumPy, torch CPU and current accelerator).

    Lightning's Trainer does not checkpoint them; dropout or sampling in a resumed run would then
    draw other numbers than the uninterrupted run. (Fabric's ``_collect_rng_states`` is private.)
    """
    import random

    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    # Tensors and plain values only, so checkpoints stay loadable with torch.load(weights_only=True).
    numpy = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import random

    import numpy as np

    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`rng_state`, indexed by global rank (a collective: call it on every rank)."""
    import torch.distributed as dist

    state = rng_state()
    if not (dist.is_available() and dist.is_initialized()):
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states
