"""CheckpointRotation: periodic, crash-safe, optionally asynchronous checkpoints with keep-last-k and best-k.

The callback decides when to save and keeps what it needs between saves; how one save is written, committed and
its failure shared is :mod:`.checkpoint_saving`, what a resumed run gets back :mod:`.checkpoint_resume`, its options
and questions to the Trainer :mod:`.checkpoint_options`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_llm._compat.known_warnings import ScopedFilters
from lightning_llm.callbacks import checkpoint_saving as saving
from lightning_llm.callbacks.checkpoint_options import (
    can_save_async,
    check_monitor_logged,
    check_remote,
    checkpoint_location,
    default_dirpath,
    validate_options,
)
from lightning_llm.callbacks.checkpoint_resume import (
    RNG_KEY,
    check_loads,
    newest_complete,
    rng_state_of_rank,
    stop_checking_loads,
)
from lightning_llm.callbacks.preemption import PreemptionFlag, stop_for_preemption
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.commit import Pending, commit, rotate
from lightning_llm.checkpointing.rng_state import gather_rng_states, set_rng_state
from lightning_llm.checkpointing.write_gate import resume_background_writes
from lightning_llm.contract import contract_of
from lightning_llm.data.batch import batch_tokens
from lightning_llm.validation import check_bool


class CheckpointRotation(ModelCheckpoint):
    """Save every N steps and/or minutes and at the end; keep the last ``keep_last`` and the best ``keep_best``.

    Crash safety: data is written under a temporary name, verified (archive readable, or every shard
    of a sharded/DeepSpeed checkpoint present; ``verify="load"`` also loads it), renamed into place,
    and then a metadata file ``step=N.ckpt.meta.json`` (step, epoch, tokens seen, parallel layout,
    hyperparameters, wall time, loss) is written atomically as the commit marker, after every rank
    finished. Only checkpoints with a marker count; at the start of ``fit``, leftovers of a crash are
    removed. Older checkpoints are deleted only after the new one is committed. The checkpoint a run
    resumed from and anything outside ``dirpath`` are never deleted. ``ckpt_path="last"``
    (``--ckpt_path last`` in the CLI) resolves to the newest complete checkpoint that verifies.

    ``dirpath`` may be a URL of any fsspec filesystem (``s3://bucket/run``, ``gs://``, ``memory://``,
    ``file://``), as with Lightning's ModelCheckpoint; every file operation goes through fsspec. Where
    the filesystem has no atomic rename (object stores), the data is written in place and the marker,
    written last in one request, is the commit (:mod:`lightning_llm.checkpointing.fs` says what
    is atomic where). Single files (single device, DDP) and LLMParallelStrategy's sharded checkpoints
    (torch's fsspec writer) can go to a URL, asynchronously too; other strategies refuse one at setup.

    ``async_save=True`` stalls training only while the state is copied to host memory: single files
    (single device, DDP) are written by a background thread, sharded checkpoints of
    LLMParallelStrategy by ``torch.distributed.checkpoint.async_save``. Strategies that offer neither
    (DeepSpeed, Lightning's FSDP/ModelParallel) save synchronously, with a warning. A save first waits
    for the previous one, and so does the end of training; rotation happens only after that wait.

    Resuming restores what Lightning restores (model, optimizer, LR schedulers, loops, the data
    module's position) and, from this callback, every rank's random generators (Lightning does not
    checkpoint them) and the count of tokens seen, so a resumed run continues as if never stopped.

    Arguments:
        dirpath: where checkpoints go, a local path or an fsspec URL (default: ``<default_root_dir>/checkpoints``,
            the same for every run whatever the logger's version, so ``ckpt_path="last"`` finds the previous run's).
        every_n_train_steps: save every this many optimizer steps (``None``: no step trigger).
        every_n_minutes: save when this much time passed since the last save (checked each step; rank 0's clock).
        keep_last: newest complete checkpoints kept (at least 1).
        monitor: metric for the best-k set (e.g. "val_loss"), read from ``trainer.callback_metrics`` at each save.
        mode: "min" or "max" for ``monitor``.
        keep_best: best checkpoints by ``monitor`` kept besides the newest ones.
        save_on_train_end: also save when training ends.
        async_save: write in the background; see above.
        verify: "files" (structure: archive complete, every shard present) or "load" (also load it)
            before older checkpoints are deleted.
        require_monitor: raise at a save where ``monitor`` was never logged (as Lightning's ModelCheckpoint
            does), naming the metrics that were; before the first validation of a run that validates, only
            warn. ``False``: save such checkpoints without a score.
        save_on_preemption: on SIGTERM (a preempted or cancelled job), every rank saves the step in progress once it
            ends, verified, and ``fit`` stops (:mod:`lightning_llm.callbacks.preemption`). ``False`` leaves SIGTERM
            to Lightning, which stops without saving.
        preemption_signals: the signals that mean preempted: SIGTERM, and on SLURM ``"SIGUSR1"`` too with
            ``#SBATCH --signal=B:USR1@120`` (:class:`~lightning_llm.callbacks.preemption.PreemptionFlag`).

    Example::

        trainer = L.Trainer(callbacks=[CheckpointRotation(every_n_train_steps=1000, keep_last=3)])
        trainer.fit(model, data, ckpt_path="last")
        CheckpointRotation(dirpath="s3://bucket/run-1", every_n_train_steps=1000)   # with s3fs installed
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = 1000,
        every_n_minutes: float | None = None,
        keep_last: int = 3,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_best: int = 0,
        save_on_train_end: bool = True,
        async_save: bool = False,
        verify: Literal["files", "load"] = "files",
        require_monitor: bool = True,
        save_on_preemption: bool = True,
        preemption_signals: Sequence[str] = ("SIGTERM",),
    ) -> None:
        validate_options(
            every_n_train_steps, every_n_minutes, keep_last, monitor, mode, keep_best, save_on_train_end, verify
        )
        check_bool("async_save", async_save)
        check_bool("require_monitor", require_monitor)
        check_bool("save_on_preemption", save_on_preemption)
        location = checkpoint_location(dirpath)  # ValueError naming an unknown protocol
        super().__init__(
            dirpath=dirpath,
            monitor=monitor,
            mode=mode,
            save_top_k=-1,
            save_last=False,
            every_n_train_steps=None,
            train_time_interval=None,
            save_on_train_epoch_end=False,
        )
        self._dirpath_arg, self.dirpath = dirpath, location  # Lightning's realpath would mangle a file:// URL
        self.save_every_n_steps, self.every_n_minutes = every_n_train_steps, every_n_minutes
        self.keep_last, self.keep_best = keep_last, keep_best
        self.save_on_train_end, self.async_save, self.verify_mode = save_on_train_end, async_save, verify
        self.tokens_seen = 0
        self._async = False
        self._last_save_time = time.monotonic()
        self._last_saved_step = self._last_step_seen = -1
        self._pending: Pending | None = None
        self._rng_to_restore: dict[str, Any] | None = None
        self.require_monitor, self._validated = require_monitor, False
        self.save_on_preemption, self._preemption = save_on_preemption, PreemptionFlag(preemption_signals)
        self._filters = ScopedFilters()  # warnings this callback answers instead, until teardown
        self.preempted = False  # True once a SIGTERM stopped this fit: the job is not finished, relaunch it
        self._resolved_last: str | None = None  # what ckpt_path="last" resolved to, verified then

    @property
    def directory(self) -> str:
        """The checkpoint directory: a local path or a URL."""
        return str(self.dirpath)

    @property
    @override
    def state_key(self) -> str:
        # Keyed by the dirpath argument only, so a resumed run may change intervals and keep counts.
        return self._generate_state_key(dirpath=self._dirpath_arg)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Not ModelCheckpoint.setup: its default directory moves with the logger's version and it
        # warns about a non-empty directory, which is how every resumed run starts.
        self.dirpath = trainer.strategy.broadcast(str(self.dirpath or default_dirpath(trainer)))
        self._fs = cfs.filesystem(self.dirpath)[0]
        if stage != "fit":
            return
        strategy = trainer.strategy
        check_remote(strategy, self.dirpath)
        self._async = can_save_async(trainer, self.async_save)
        check_loads(trainer, lambda: self._resolved_last)
        if trainer.is_global_zero:
            saving.start_clean(self.directory)
        trainer.strategy.barrier("CheckpointRotation.setup")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._preemption.uninstall()  # also after an exception, before Lightning restores the original handlers
        stop_checking_loads(trainer)
        self._filters.remove()
        super().teardown(trainer, pl_module, stage)

    @override
    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        # Lightning resolves ckpt_path="last" through this hook (before setup), newest file among the candidates.
        # Every rank checks the same files (no process group exists yet to share the work), so all pick the same.
        last = newest_complete(self.dirpath or default_dirpath(trainer), self._filters)
        if last is None:
            return set()
        self._resolved_last = last
        return {last}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resumed run's state at this step is the checkpoint it resumed from: never save it again.
        self._last_saved_step = self._last_step_seen = trainer.global_step
        self._last_save_time = time.monotonic()
        self.preempted = False
        if self.save_on_preemption:  # after Lightning installed its SIGTERM handler, which this one stands in for
            self._preemption.install()
        if self._rng_to_restore is not None:  # restored last, so nothing between here and the step draws from it
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[RNG_KEY] = gather_rng_states()

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        state = rng_state_of_rank(trainer, checkpoint)
        if state is not None:
            self._rng_to_restore = state

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        resume_background_writes()  # a write held since the last save starts now that training has resumed

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with contextlib.suppress(TypeError):  # a batch without a (batch, seq_len) tensor: tokens are not counted
            self.tokens_seen += batch_tokens(batch, shifted_targets=True)[1] * contract_of(trainer).layout.dp
        step = trainer.global_step
        stepped, self._last_step_seen = step != self._last_step_seen, step
        if not stepped:  # accumulating
            return
        # One all-reduce of a bit per optimizer step (multi-rank only): Lightning already syncs the host at every step
        # start for its own SIGTERM broadcast, so this adds a tiny collective's latency, and a signal is acted on
        # within one step of the grace period.
        if self.save_on_preemption and self._preemption.any_rank(trainer.strategy):
            self._save_for_preemption(trainer, pl_module)
            return
        if step == self._last_saved_step:
            return
        by_steps = self.save_every_n_steps is not None and step % self.save_every_n_steps == 0
        by_time = self.every_n_minutes is not None and self._minutes_since_save(trainer) >= self.every_n_minutes
        if by_steps or by_time:
            self._save(trainer, pl_module)

    def _save_for_preemption(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        start, saved_now = time.monotonic(), trainer.global_step != self._last_saved_step
        self.preempted = True
        if saved_now:
            self._save(trainer, pl_module, sync=True)
        self._finish_pending(trainer)  # an asynchronous save still in flight is committed before the exit
        stop_for_preemption(trainer, saved_now, time.monotonic() - start, self._preemption.name)

    def _minutes_since_save(self, trainer: L.Trainer) -> float:
        # Rank 0's clock decides, so every rank takes part in the same saves.
        return trainer.strategy.broadcast((time.monotonic() - self._last_save_time) / 60)

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # saving follows steps and time, not epochs

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        self._validated = True  # from now on a missing validation metric is an error, not "not yet"

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._preemption.uninstall()
        if self.save_on_train_end and trainer.global_step != self._last_saved_step:
            self._save(trainer, pl_module)
        self._finish_pending(trainer)

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule, sync: bool = False) -> None:
        self._finish_pending(trainer)
        if self.require_monitor:
            check_monitor_logged(trainer, self.monitor, validated=self._validated)
        pending = saving.pending_save(trainer, pl_module, self.directory, self.tokens_seen, self.monitor)
        background = self._async and not sync
        # Rank 0 commits an asynchronous save as soon as it is written, unless the commit loads it (verify="load").
        commit_behind = background and trainer.is_global_zero and self.verify_mode != "load"
        rotation = (lambda: self._rotate(pending.resumed_from)) if commit_behind else None
        saving.write(trainer, pending, self.directory, background=background, then=rotation)
        self._pending = pending
        self._last_saved_step, self._last_save_time = trainer.global_step, time.monotonic()
        if not background or pending.error is not None:
            self._finish_pending(trainer)

    def _finish_pending(self, trainer: L.Trainer) -> None:
        """Wait for the pending save on every rank; rank 0 commits it and rotates.

        A failure on any rank (the write, the background writer, verification, the commit) is shared with
        every rank, and all raise the same error, naming the directory, the cause and the checkpoint kept.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = saving.settle(trainer, pending, self.directory, self._commit)
        if error is not None:
            raise saving.save_failure(pending, self.directory, error)

    def _commit(self, pending: Pending) -> None:
        """Rank 0: commit a written save and rotate (both done already for a save committed in the background)."""
        if pending.committed:
            self.last_model_path = str(pending.final)
            return
        commit(pending, trial_load=self.verify_mode == "load")
        self.last_model_path = str(pending.final)
        self._rotate(pending.resumed_from)

    def _rotate(self, resumed_from: str | None) -> None:
        best = rotate(
            self.directory,
            keep_last=self.keep_last,
            keep_best=self.keep_best,
            monitor=self.monitor,
            mode=self.mode,
            resumed_from=resumed_from,
        )
        if best is not None:
            self.best_model_path, self.best_model_score = str(best[0]), torch.tensor(best[1])

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen, "dirpath": self.dirpath}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens_seen = state_dict.get("tokens_seen", 0)
