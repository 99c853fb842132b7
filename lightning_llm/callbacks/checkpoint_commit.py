"""Committing and rotating CheckpointRotation's checkpoints, and checking its options (rank 0's file work).

A checkpoint counts once its marker is written: the data is verified, checksummed, and (on a local
disk) made durable and renamed into place first; on other filesystems it was written in place and
the marker alone commits it (:mod:`.checkpoint_fs`). Rotation deletes only complete checkpoints that
are neither among the newest, the best, nor the one the run resumed from, and nothing outside the
checkpoint directory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.callbacks import checkpoint_checksums as checksums
from lightning_llm.callbacks import checkpoint_files as files
from lightning_llm.callbacks import checkpoint_fs as cfs
from lightning_llm.callbacks.checkpoint_fs import Location
from lightning_llm.contract import contract_of
from lightning_llm.validation import check_float, check_int


@dataclass
class Pending:
    """A save whose files may still be in flight: committed (rank 0) and rotated once they are written."""

    tmp: str  # where the data is written: ``final`` itself where the filesystem cannot rename (staging_location)
    final: str
    meta: dict[str, Any]
    resumed_from: str | None
    future: Future | None = None  # an asynchronous save's files on this rank
    error: str | None = None  # why writing failed on this rank
    committed: bool = False  # by rank 0's background thread, after an asynchronous write


def committed_after(write: Future, pending: Pending, then: Callable[[], None]) -> Future:
    """Rank 0 of an asynchronous save: once ``write`` is done, :func:`commit` it and call ``then`` (rotation),
    in a background thread; the returned future resolves after both.

    Verifying, checksumming and fsyncing every byte would otherwise stall training when the next save
    finds this one pending. The order of the steps, and so what a crash at any point leaves, is the
    synchronous commit's. DCP's future on rank 0 resolves only after every rank's shards and the
    metadata are written.
    """
    def run() -> None:
        write.result()
        commit(pending, trial_load=False)
        pending.committed = True
        then()

    return _background().submit(run)


_BACKGROUND: ThreadPoolExecutor | None = None


def _background() -> ThreadPoolExecutor:
    global _BACKGROUND
    if _BACKGROUND is None:  # one worker: commits and rotations happen in the order of the saves
        _BACKGROUND = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
    return _BACKGROUND


def commit(pending: Pending, *, trial_load: bool) -> None:
    """Verify the written data, record its checksums, rename it into place (local disks) and write its marker last."""
    world_size = pending.meta["layout"]["world_size"]
    files.verify(pending.tmp, trial_load=trial_load, world_size=world_size)
    pending.meta["checksums"] = checksums.compute(pending.tmp)  # of the bytes verified above
    if pending.tmp != pending.final:
        files.fsync_tree(pending.tmp)  # the data must be durable before a marker says it is complete
        if cfs.exists(pending.final):  # a run resumed from an older checkpoint reached this step again
            files.remove(pending.final)
        cfs.replace(pending.tmp, pending.final)
        cfs.fsync_dir(cfs.parent(pending.final))
    files.write_json_atomically(files.marker_path(pending.final), pending.meta)


def staging_location(final: str, trainer: L.Trainer) -> str:
    """Where a checkpoint is written before it is committed: a temporary name beside ``final`` on a local disk
    (renamed into place by :func:`commit`), ``final`` itself where the filesystem has no atomic rename.

    Written in place, an older checkpoint of the same step (a timeline abandoned by resuming an older
    checkpoint) is removed first, marker first, by rank 0 while the other ranks wait.
    """
    if cfs.is_local(final):
        return cfs.sibling(final, files.TMP_PREFIX + cfs.name(final))
    if trainer.is_global_zero:
        files.remove(final)
    trainer.strategy.barrier("CheckpointRotation.save")
    return final


def rotate(directory: Location, *, keep_last: int, keep_best: int, monitor: str | None, mode: str,
           resumed_from: str | None) -> tuple[str, float] | None:
    """Delete what is not kept; return the best checkpoint by ``monitor`` and its score (None if none is scored)."""
    complete = files.complete_checkpoints(directory)
    keep = set(complete[-keep_last:])
    scores = {path: meta["score"] for path in complete
              if (meta := files.read_marker(path)) and meta.get("monitor") == monitor and "score" in meta}
    best = sorted(scores, key=scores.get, reverse=mode == "max")
    keep |= set(best[:keep_best])
    for path in complete:
        resumed = resumed_from is not None and cfs.same(path, resumed_from)
        if path in keep or resumed or not cfs.same(cfs.parent(path), directory):
            continue
        files.remove(path)
    return (best[0], scores[best[0]]) if best else None


def newest_verified(directory: Location) -> str | None:
    """The newest complete checkpoint in ``directory`` whose content matches its marker's checksums (``ckpt_path="last"``).

    A newer one that fails verification is skipped with a warning naming it; if every one fails, that is an
    error rather than a silent fresh start. ``None`` when there is no complete checkpoint at all.
    """
    complete = files.complete_checkpoints(directory)
    skipped = []
    for checkpoint in reversed(complete):
        try:
            checksums.verify_committed(checkpoint)
        except RuntimeError as err:
            rank_zero_warn(f"CheckpointRotation: ckpt_path='last' skips {checkpoint}, the newest complete "
                           f"checkpoint that fails verification ({err}); falling back to an older one.")
            skipped.append(cfs.name(checkpoint))
            continue
        return checkpoint
    if skipped:
        raise RuntimeError(f"ckpt_path='last': every checkpoint in {directory} fails verification ({skipped}). "
                           "Restore them from a backup, or start without ckpt_path.")
    return None


def last_candidate(checkpoint: str) -> str:
    """What to hand Lightning for ``ckpt_path="last"``: ``checkpoint``, or its marker where Lightning could not read
    the checkpoint's modification time.

    Lightning picks "last" among the candidates by ``fs.modified(path)``, which filesystems without real
    directories (object stores, ``memory://``) cannot answer for a sharded checkpoint's directory (a bare
    ``FileNotFoundError``). The marker is a file written with the checkpoint; LLMParallelStrategy, the one
    strategy that writes sharded checkpoints there, loads the checkpoint a marker names
    (:func:`.checkpoint_files.checkpoint_of`), and ``trainer.ckpt_path`` names the marker.
    """
    fs, path = cfs.filesystem(checkpoint)
    try:
        fs.modified(path)
    except (OSError, NotImplementedError, KeyError):
        return files.marker_path(checkpoint)
    return checkpoint


def validate_options(every_n_train_steps, every_n_minutes, keep_last, monitor, keep_best, save_on_train_end, verify) -> None:
    """Refuse CheckpointRotation arguments that cannot work, naming the value and what is allowed."""
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
        raise ValueError("CheckpointRotation would never save: set every_n_train_steps, every_n_minutes or "
                         "save_on_train_end=True.")
    if keep_best < 0:
        raise ValueError(f"keep_best={keep_best} must be 0 or more.")
    if keep_best and monitor is None:
        raise ValueError(f"keep_best={keep_best} needs `monitor`, the metric that ranks checkpoints.")
    if verify not in ("files", "load"):
        raise ValueError(f"verify={verify!r}: choose 'files' or 'load'.")


def default_dirpath(trainer: L.Trainer) -> str:
    """``<default_root_dir>/checkpoints``: the same for every run, whatever the logger's version."""
    return cfs.join(trainer.default_root_dir, "checkpoints")


def check_writable(directory: Location) -> None:
    """Refuse a checkpoint directory that cannot be written (or whose URL names no usable filesystem), before
    training starts."""
    fs, path = cfs.filesystem(directory)  # ValueError naming an unknown protocol
    try:
        fs.makedirs(path, exist_ok=True)
        probe = cfs.join(path, files.TMP_PREFIX + "write-test")
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except OSError as err:
        raise ValueError(
            f"CheckpointRotation cannot write to {directory} ({err.strerror or err}); choose a writable dirpath."
        ) from err


def check_remote(strategy: Any, dirpath: str) -> None:
    """Refuse a ``dirpath`` off the local disk for strategies that write checkpoints with local file APIs.

    Single files written through the strategy's CheckpointIO (single device, DDP: Lightning's
    ``TorchCheckpointIO`` writes through fsspec) and LLMParallelStrategy's sharded checkpoints (torch's
    fsspec writer) go anywhere; DeepSpeed, Lightning's FSDP/ModelParallel strategies and
    ``save_distributed_checkpoint=False`` would write a directory named like the URL on the local disk.
    A ``memory://`` filesystem lives in one process, so it cannot hold the checkpoints of several.
    """
    from fsspec.implementations.memory import MemoryFileSystem
    from lightning.pytorch.strategies import Strategy

    from lightning_llm.strategies.checkpoint_hooks import ShardedCheckpointHooks

    if isinstance(cfs.filesystem(dirpath)[0], MemoryFileSystem) and strategy.world_size > 1:
        raise ValueError(
            f"CheckpointRotation(dirpath={dirpath!r}): a memory:// filesystem lives in one process, and this run has "
            f"{strategy.world_size} processes that would each see only their own. Use a local or shared dirpath "
            "(a path, file://, s3://...)."
        )
    if cfs.is_local(dirpath) or type(strategy).save_checkpoint is Strategy.save_checkpoint:
        return
    if isinstance(strategy, ShardedCheckpointHooks) and strategy.writes_sharded_checkpoints:
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
        rank_zero_warn(f"CheckpointRotation(async_save=True): {type(trainer.strategy).__name__} offers no "
                       "asynchronous save; checkpoints are written synchronously.")
        return False
    return True


def metadata(trainer: L.Trainer, pl_module: L.LightningModule, tokens_seen: int, monitor: str | None) -> dict[str, Any]:
    """What a commit marker records besides the checksums: step, epoch, tokens, layout, hyperparameters, time, loss."""
    loss = trainer.callback_metrics.get("train_loss")
    score = trainer.callback_metrics.get(monitor) if monitor else None
    return {
        "step": trainer.global_step, "epoch": trainer.current_epoch, "tokens_seen": tokens_seen,
        "layout": contract_of(trainer).layout.as_dict(), "config": dict(pl_module.hparams), "wall_time": time.time(),
        "loss": float(loss) if loss is not None else None,
        **({"monitor": monitor, "score": float(score)} if score is not None else {}),
    }
