"""How :class:`~lightning_llm.callbacks.CheckpointRotation` writes one checkpoint and settles it on every rank.

A save is a :class:`~lightning_llm.checkpointing.commit.Pending` (:func:`pending_save`): :func:`write` starts it (synchronously, through a
guarded ``CheckpointIO``, or in the background), :func:`settle` waits for it on every rank, has rank 0 commit it (or
remove a partial write) and shares one verdict with all ranks, and :func:`save_failure` is the error they all raise.
The on-disk protocol itself (commit, rotation, verification) is :mod:`lightning_llm.checkpointing`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning as L

from lightning_llm.callbacks.checkpoint_options import metadata, staging_location
from lightning_llm.checkpointing import errors, files
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.commit import Pending, check_writable, committed_after
from lightning_llm.checkpointing.errors import GuardedWrite
from lightning_llm.checkpointing.write_gate import resume_background_writes
from lightning_llm.contract import contract_of

log = logging.getLogger(__name__)


def start_clean(directory: str) -> None:
    """Rank 0 at setup: ``directory`` is writable, and what a crashed save left in it is removed."""
    check_writable(directory)
    for leftover in files.clean_incomplete(directory):
        log.warning("CheckpointRotation: removed incomplete checkpoint leftover %s", leftover)


def pending_save(
    trainer: L.Trainer, pl_module: L.LightningModule, directory: str, tokens_seen: int, monitor: str | None
) -> Pending:
    """A save of this step: its name in ``directory``, where it is staged, what its marker records, and the
    checkpoint this run resumed from (which rotation never deletes)."""
    final = cfs.join(directory, f"step={trainer.global_step:08d}.ckpt")
    tmp = staging_location(final, trainer)
    resumed_from = files.checkpoint_of(trainer.ckpt_path) if trainer.ckpt_path else None  # not its marker
    return Pending(tmp, final, metadata(trainer, pl_module, tokens_seen, monitor), resumed_from)


def write(
    trainer: L.Trainer,
    pending: Pending,
    directory: str,
    *,
    background: bool,
    then: Callable[[], None] | None = None,
) -> None:
    """Write the trainer's checkpoint to ``pending.tmp``; a failure is kept in ``pending.error``, not raised.

    ``background``: return once the state is staged in host memory, the files written meanwhile
    (``pending.future``); ``then`` (rank 0's rotation) runs after the write is committed in the background too.
    Strategies that write collectively (DCP, DeepSpeed) fail on every rank alike; a single file is written by rank 0
    alone, so its failure is caught inside the write (``GuardedWrite``), not here.
    """
    try:
        if background:
            pending.future = contract_of(trainer).save_checkpoint_async(str(pending.tmp))
            if then is not None:
                pending.future = committed_after(pending.future, pending, then)
        elif contract_of(trainer).saves_through_checkpoint_io:
            _guarded_write(trainer, pending, directory)
        else:
            trainer.save_checkpoint(pending.tmp)
    except errors.SAVE_ERRORS as err:
        pending.error = errors.describe(err, directory)


def _guarded_write(trainer: L.Trainer, pending: Pending, directory: str) -> None:
    """A single-file save through the strategy's ``CheckpointIO``, wrapped for this save only."""
    strategy = trainer.strategy
    strategy.checkpoint_io = guard = GuardedWrite(strategy.checkpoint_io)
    try:
        trainer.save_checkpoint(pending.tmp)
    finally:
        strategy.checkpoint_io = guard.inner
    if guard.error is not None:
        pending.error = errors.describe(guard.error, directory)


def settle(trainer: L.Trainer, pending: Pending, directory: str, commit: Callable[[Pending], None]) -> str | None:
    """Wait for ``pending`` on every rank; rank 0 then calls ``commit(pending)`` if every rank wrote it, or removes
    the partial write. Returns the error every rank shares (a failed write, background writer, verification or
    commit on any rank), ``None`` once committed."""
    resume_background_writes()
    error = pending.error
    try:
        if pending.future is not None:
            pending.future.result()
    except errors.SAVE_ERRORS as err:
        error = error or errors.describe(err, directory)
    error = errors.summary(errors.gather(error))
    if trainer.is_global_zero:
        try:
            if error is None:
                commit(pending)
            else:
                files.remove(pending.tmp)  # a partial write only takes space
        except errors.SAVE_ERRORS as err:
            error = error or errors.describe(err, directory)
    # A broadcast, not a bare raise on rank 0: every rank stops, none waits forever in a collective.
    return trainer.strategy.broadcast(error)


def save_failure(pending: Pending, directory: str, error: str) -> RuntimeError:
    """The error every rank raises for a save that failed: the directory, the cause and the checkpoint kept."""
    complete = files.complete_checkpoints(directory)
    kept = f"the newest complete checkpoint, {complete[-1]}, is kept" if complete else "no earlier checkpoint exists"
    return RuntimeError(
        f"CheckpointRotation could not save checkpoint {cfs.name(pending.final)} in {directory}: {error}. "
        f"Nothing was committed and {kept}. Free space or fix the permissions under {directory}, then "
        "resume with ckpt_path='last'."
    )
