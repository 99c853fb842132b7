"""CheckpointRotation's dealings with the Trainer: its options, where a save is staged, what a marker records, and
whether the metric that ranks checkpoints was logged.

The on-disk protocol itself (commit, rotation, verification) is :mod:`lightning_llm.checkpointing`; this module
asks the trainer and its strategy (through :func:`~lightning_llm.contract.contract_of`) what that protocol needs.
"""

from __future__ import annotations

import os
import time
from typing import Any

import lightning as L
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.checkpointing import files
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.contract import contract_of
from lightning_llm.validation import check_bool, check_float, check_int


def staging_location(final: str, trainer: L.Trainer) -> str:
    """Where a checkpoint is written before it is committed: a temporary name beside ``final`` on a local disk
    (renamed into place by :func:`~lightning_llm.checkpointing.commit.commit`), ``final`` itself where the filesystem has no atomic rename.

    Written in place, an older checkpoint of the same step (a timeline abandoned by resuming an older
    checkpoint) is removed first, marker first, by rank 0 while the other ranks wait.
    """
    if cfs.is_local(final):
        return cfs.sibling(final, files.TMP_PREFIX + cfs.name(final))
    if trainer.is_global_zero:
        files.remove(final)
    trainer.strategy.barrier("CheckpointRotation.save")
    return final


def validate_options(
    every_n_train_steps, every_n_minutes, keep_last, monitor, mode, keep_best, save_on_train_end, verify
) -> None:
    """Refuse CheckpointRotation arguments that cannot work, naming the value and what is allowed."""
    check_bool("save_on_train_end", save_on_train_end)  # "false" would otherwise mean True
    check_int("keep_last", keep_last)
    check_int("every_n_train_steps", every_n_train_steps, optional=True)
    check_float("every_n_minutes", every_n_minutes, optional=True)
    check_int("keep_best", keep_best)
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: at least 1 checkpoint must be kept (the newest complete one).")
    if every_n_train_steps is not None and every_n_train_steps < 1:
        raise ValueError(f"every_n_train_steps={every_n_train_steps} must be a positive number of steps, or None.")
    if every_n_minutes is not None and every_n_minutes <= 0:
        raise ValueError(f"every_n_minutes={every_n_minutes} must be a positive number of minutes, or None.")
    if every_n_train_steps is None and every_n_minutes is None and not save_on_train_end:
        raise ValueError(
            "CheckpointRotation would never save: set every_n_train_steps, every_n_minutes or save_on_train_end=True."
        )
    if keep_best < 0:
        raise ValueError(f"keep_best={keep_best} must be 0 or more.")
    if keep_best and monitor is None:
        raise ValueError(f"keep_best={keep_best} needs `monitor`, the metric that ranks checkpoints.")
    if monitor is not None and (not isinstance(monitor, str) or not monitor):
        raise ValueError(f"monitor={monitor!r} must name a logged metric (e.g. 'val_loss'), or be None.")
    if mode not in ("min", "max"):
        raise ValueError(f"mode={mode!r}: choose 'min' (lower `monitor` is better) or 'max'.")
    if verify not in ("files", "load"):
        raise ValueError(f"verify={verify!r}: choose 'files' or 'load'.")


def default_dirpath(trainer: L.Trainer) -> str:
    """``<default_root_dir>/checkpoints``: the same for every run, whatever the logger's version."""
    return cfs.join(trainer.default_root_dir, "checkpoints")


def check_remote(strategy: Any, dirpath: str) -> None:
    """Refuse a ``dirpath`` off the local disk for strategies that write checkpoints with local file APIs.

    Whether a strategy can write to a URL is its contract's ``saves_to_urls``: single files written through the
    strategy's CheckpointIO (single device, DDP: Lightning's ``TorchCheckpointIO`` writes through fsspec) and
    LLMParallelStrategy's sharded checkpoints (torch's fsspec writer) go anywhere; DeepSpeed, Lightning's
    FSDP/ModelParallel strategies and ``save_distributed_checkpoint=False`` would write a directory named like
    the URL on the local disk. A ``memory://`` filesystem lives in one process, so it cannot hold the checkpoints
    of several.
    """
    from fsspec.implementations.memory import MemoryFileSystem

    if isinstance(cfs.filesystem(dirpath)[0], MemoryFileSystem) and strategy.world_size > 1:
        raise ValueError(
            f"CheckpointRotation(dirpath={dirpath!r}): a memory:// filesystem lives in one process, and this run has "
            f"{strategy.world_size} processes that would each see only their own. Use a local or shared dirpath "
            "(a path, file://, s3://...)."
        )
    if cfs.is_local(dirpath) or contract_of(strategy).saves_to_urls:
        return
    raise ValueError(
        f"CheckpointRotation(dirpath={dirpath!r}): {type(strategy).__name__} writes checkpoints with local file "
        "APIs, so it cannot save to a URL. Use a local dirpath (and copy the checkpoints with your storage's tools), "
        "or LLMParallelStrategy with sharded checkpoints (the default), which writes through fsspec."
    )


def can_save_async(trainer: L.Trainer, requested: bool) -> bool:
    """Whether this run's saves are asynchronous: ``requested`` and the strategy offers it (else a warning)."""
    if isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
        raise ValueError(
            "CheckpointRotation cannot tell when an AsyncCheckpointIO save is complete, so it could not commit "
            "it safely. Remove the AsyncCheckpointIO plugin and use CheckpointRotation(async_save=True)."
        )
    if not requested:
        return False
    if not contract_of(trainer).supports_async_save:
        rank_zero_warn(
            f"CheckpointRotation(async_save=True): {type(trainer.strategy).__name__} offers no "
            "asynchronous save; checkpoints are written synchronously."
        )
        return False
    return True


def metadata(trainer: L.Trainer, pl_module: L.LightningModule, tokens_seen: int, monitor: str | None) -> dict[str, Any]:
    """What a commit marker records besides the checksums: step, epoch, tokens, layout, hyperparameters, time, loss."""
    loss = trainer.callback_metrics.get("train_loss")
    score = trainer.callback_metrics.get(monitor) if monitor else None
    return {
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "tokens_seen": tokens_seen,
        "layout": contract_of(trainer).layout.as_dict(),
        "config": dict(pl_module.hparams),
        "wall_time": time.time(),
        "loss": float(loss) if loss is not None else None,
        **({"monitor": monitor, "score": float(score)} if score is not None else {}),
    }


def checkpoint_location(dirpath: Any) -> str | None:
    """``dirpath`` as CheckpointRotation keeps it (an fsspec URL normalized), or ``None`` for the default; refused
    when it names no directory or an unknown protocol."""
    if dirpath is not None and (not isinstance(dirpath, (str, os.PathLike)) or not str(dirpath).strip()):
        raise ValueError(
            f"dirpath={dirpath!r} names no directory; give a path or URL, or leave it None for "
            "<default_root_dir>/checkpoints."
        )
    return cfs.normalize(dirpath) if dirpath is not None else None


def check_monitor_logged(trainer: L.Trainer, monitor: str | None, *, validated: bool) -> None:
    """Refuse to save without the ranking metric ``monitor``: best-k would silently keep nothing.

    Rank 0 decides for all. Before the first validation of a run that validates (``validated`` false), only warn:
    that checkpoint is saved without a score.
    """
    if monitor is None:
        return
    logged = sorted(trainer.callback_metrics)
    if not trainer.strategy.broadcast(monitor not in logged):
        return
    message = (
        f"CheckpointRotation(monitor={monitor!r}): no metric {monitor!r} was logged by step "
        f"{trainer.global_step}; the logged metrics are {logged}. Log it with "
        f"self.log({monitor!r}, value) in the LightningModule, or correct the name (or pass "
        "require_monitor=False to save checkpoints without a score)."
    )
    if trainer.enable_validation and not validated:
        rank_zero_warn(message + " Validation has not run yet: this checkpoint is saved without a score.")
        return
    raise ValueError(message)
