"""Committing and rotating CheckpointRotation's checkpoints (rank 0's file work).

A checkpoint counts once its marker is written: the data is verified, checksummed, and (on a local
disk) made durable and renamed into place first; on other filesystems it was written in place and
the marker alone commits it (:mod:`.fs`). Rotation deletes only complete checkpoints that
are neither among the newest, the best, nor the one the run resumed from, and nothing outside the
checkpoint directory.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.checkpointing import checksums, files
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.fs import Location


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


def rotate(
    directory: Location, *, keep_last: int, keep_best: int, monitor: str | None, mode: str, resumed_from: str | None
) -> tuple[str, float] | None:
    """Delete what is not kept; return the best checkpoint by ``monitor`` and its score (None if none is scored)."""
    complete = files.complete_checkpoints(directory)
    keep = set(complete[-keep_last:])
    scores = {
        path: meta["score"]
        for path in complete
        if (meta := files.read_marker(path)) and meta.get("monitor") == monitor and "score" in meta
    }
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
            rank_zero_warn(
                f"CheckpointRotation: ckpt_path='last' skips {checkpoint}, the newest complete "
                f"checkpoint that fails verification ({err}); falling back to an older one."
            )
            skipped.append(cfs.name(checkpoint))
            continue
        return checkpoint
    if skipped:
        raise RuntimeError(
            f"ckpt_path='last': every checkpoint in {directory} fails verification ({skipped}). "
            "Restore them from a backup, or start without ckpt_path."
        )
    return None


def last_candidate(checkpoint: str) -> str:
    """What to hand Lightning for ``ckpt_path="last"``: ``checkpoint``, or its marker where Lightning could not read
    the checkpoint's modification time.

    Lightning picks "last" among the candidates by ``fs.modified(path)``, which filesystems without real
    directories (object stores, ``memory://``) cannot answer for a sharded checkpoint's directory (a bare
    ``FileNotFoundError``). The marker is a file written with the checkpoint; LLMParallelStrategy, the one
    strategy that writes sharded checkpoints there, loads the checkpoint a marker names
    (:func:`.files.checkpoint_of`), and ``trainer.ckpt_path`` names the marker.
    """
    fs, path = cfs.filesystem(checkpoint)
    try:
        fs.modified(path)
    except (OSError, NotImplementedError, KeyError):
        return files.marker_path(checkpoint)
    return checkpoint


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
