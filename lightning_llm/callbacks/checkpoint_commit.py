"""Committing and rotating CheckpointRotation's checkpoints, and checking its options (rank 0's file work).

A checkpoint counts once its marker is written: the data is verified, checksummed, made durable and
renamed into place first. Rotation deletes only complete checkpoints that are neither among the newest,
the best, nor the one the run resumed from, and nothing outside the checkpoint directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.callbacks import checkpoint_checksums as checksums
from lightning_llm.callbacks import checkpoint_files as files
from lightning_llm.validation import check_float, check_int


@dataclass
class Pending:
    """A save whose files may still be in flight: committed (rank 0) and rotated once they are written."""

    tmp: Path
    final: Path
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
    """Verify the written data, record its checksums, rename it into place and write its marker last."""
    world_size = pending.meta["layout"]["world_size"]
    files.verify(pending.tmp, trial_load=trial_load, world_size=world_size)
    pending.meta["checksums"] = checksums.compute(pending.tmp)  # of the bytes verified above
    files.fsync_tree(pending.tmp)  # the data must be durable before a marker says it is complete
    if pending.final.exists():  # a run resumed from an older checkpoint reached this step again
        files.remove(pending.final)
    os.replace(pending.tmp, pending.final)
    files.fsync_dir(pending.final.parent)
    files.write_json_atomically(files.marker_path(pending.final), pending.meta)


def rotate(directory: Path, *, keep_last: int, keep_best: int, monitor: str | None, mode: str,
           resumed_from: str | None) -> tuple[Path, float] | None:
    """Delete what is not kept; return the best checkpoint by ``monitor`` and its score (None if none is scored)."""
    complete = files.complete_checkpoints(directory)
    keep = set(complete[-keep_last:])
    scores = {path: meta["score"] for path in complete
              if (meta := files.read_marker(path)) and meta.get("monitor") == monitor and "score" in meta}
    best = sorted(scores, key=scores.get, reverse=mode == "max")
    keep |= set(best[:keep_best])
    resumed = Path(resumed_from).resolve() if resumed_from else None
    inside = directory.resolve()
    for path in complete:
        if path in keep or path.resolve() == resumed or path.resolve().parent != inside:
            continue
        files.remove(path)
    return (best[0], scores[best[0]]) if best else None


def newest_verified(directory: Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` whose content matches its marker's checksums (``ckpt_path="last"``).

    A newer one that fails verification is skipped with a warning naming it; if every one fails, that is an
    error rather than a silent fresh start. ``None`` when there is no complete checkpoint at all.
    """
    complete = files.complete_checkpoints(directory) if directory.is_dir() else []
    skipped = []
    for checkpoint in reversed(complete):
        try:
            checksums.verify_committed(checkpoint)
        except RuntimeError as err:
            rank_zero_warn(f"CheckpointRotation: ckpt_path='last' skips {checkpoint}, the newest complete "
                           f"checkpoint that fails verification ({err}); falling back to an older one.")
            skipped.append(checkpoint.name)
            continue
        return checkpoint
    if skipped:
        raise RuntimeError(f"ckpt_path='last': every checkpoint in {directory} fails verification ({skipped}). "
                           "Restore them from a backup, or start without ckpt_path.")
    return None


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
    return os.path.join(trainer.default_root_dir, "checkpoints")


def check_writable(directory: Path) -> None:
    """Refuse a checkpoint directory that cannot be written, before training starts."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / (files.TMP_PREFIX + "write-test")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"CheckpointRotation cannot write to {directory} ({err.strerror}); choose a writable dirpath."
        ) from err
