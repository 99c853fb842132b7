"""CheckpointRotation: periodic, crash-safe, optionally asynchronous checkpoints with keep-last-k and best-k."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_llm.callbacks import checkpoint_files as files
from lightning_llm.callbacks.mfu import batch_tokens, data_parallel_size

log = logging.getLogger(__name__)


class CheckpointRotation(ModelCheckpoint):
    """Save every N steps and/or minutes and at the end; keep the last ``keep_last`` and the best ``keep_best``.

    Crash safety: data is written under a temporary name and renamed into place, and a metadata
    file (step, epoch, tokens seen, parallel layout, hyperparameters, wall time, loss) is written
    last as the commit marker, after every rank finished. Only checkpoints with a marker count; on
    start, leftovers of a crash are removed. Older checkpoints are deleted only after the new one is
    complete and verified (archive readable, or every shard of a sharded checkpoint present;
    ``verify="load"`` also loads it). The checkpoint a run resumed from and anything outside
    ``dirpath`` are never deleted. ``ckpt_path="last"`` (``--ckpt_path last`` in the CLI) resolves
    to the newest complete checkpoint.

    ``async_save=True`` stalls training only while the state is copied: single-file checkpoints are
    written by a background thread, sharded ones by ``torch.distributed.checkpoint.async_save``
    (LLMParallelStrategy). A save waits for the previous one; so does the end of training.

    Arguments:
        dirpath: where checkpoints go (default: ``<default_root_dir>/checkpoints``).
        every_n_train_steps: save every this many optimizer steps.
        every_n_minutes: save when this much time passed since the last save (checked each step).
        keep_last: newest checkpoints kept (at least 1).
        monitor: metric for the best-k set (e.g. "val_loss"); ``keep_best`` of them are kept too.
        mode: "min" or "max" for ``monitor``.
        keep_best: best checkpoints kept besides the newest ones.
        save_on_train_end: save when training ends.
        async_save: write in the background; see above.
        verify: "files" (structure) or "load" (also load the checkpoint) before older ones are deleted.

    Example::

        trainer = L.Trainer(callbacks=[CheckpointRotation(every_n_train_steps=1000, keep_last=3)])
        trainer.fit(model, data, ckpt_path="last")
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
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: at least 1 checkpoint must be kept (the newest complete one).")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps={every_n_train_steps} must be a positive number of steps, or None.")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes={every_n_minutes} must be a positive number of minutes, or None.")
        if keep_best and monitor is None:
            raise ValueError(f"keep_best={keep_best} needs `monitor`, the metric that ranks checkpoints.")
        if verify not in ("files", "load"):
            raise ValueError(f"verify={verify!r}: choose 'files' or 'load'.")
        super().__init__(
            dirpath=dirpath, monitor=monitor, mode=mode, save_top_k=-1, save_last=False,
            every_n_train_steps=None, train_time_interval=None, save_on_train_epoch_end=False,
        )
        self.save_every_n_steps = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self.keep_last, self.keep_best = keep_last, keep_best
        self.save_on_train_end, self.async_save, self.verify_mode = save_on_train_end, async_save, verify
        self.tokens_seen = 0
        self.scores: dict[str, float] = {}
        self._last_save_time = time.monotonic()
        self._last_saved_step = -1
        self._last_step_seen = -1
        self._pending: tuple[Path, Path, dict, Future | None] | None = None
        self._writer: ThreadPoolExecutor | None = None

    @property
    def directory(self) -> Path:
        return Path(self.dirpath)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        directory = self.directory
        if trainer.is_global_zero:
            _check_writable(directory)
            for leftover in files.clean_incomplete(directory):
                log.warning("CheckpointRotation: removed incomplete checkpoint leftover %s", leftover)
        trainer.strategy.barrier("CheckpointRotation.setup")

    @override
    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        complete = files.complete_checkpoints(Path(self.dirpath)) if self.dirpath and os.path.isdir(self.dirpath) else []
        return {str(complete[-1])} if complete else set()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        try:
            self.tokens_seen += batch_tokens(batch, shifted_targets=True)[1] * data_parallel_size(trainer)
        except TypeError:
            pass
        step = trainer.global_step
        stepped, self._last_step_seen = step != self._last_step_seen, step
        if not stepped or step == self._last_saved_step:  # accumulating, or saved already
            return
        by_steps = self.save_every_n_steps is not None and step % self.save_every_n_steps == 0
        by_time = self.every_n_minutes is not None and self._minutes_since_save(trainer) >= self.every_n_minutes
        if by_steps or by_time:
            self._save(trainer, pl_module)

    def _minutes_since_save(self, trainer) -> float:
        # Rank 0's clock decides, so every rank takes part in the same saves.
        minutes = (time.monotonic() - self._last_save_time) / 60
        return trainer.strategy.broadcast(minutes)

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # saving follows steps and time, not epochs

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        pass

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_on_train_end and trainer.global_step != self._last_saved_step:
            self._save(trainer, pl_module)
        self._finish_pending(trainer)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish_pending(trainer)
        step = trainer.global_step
        final = self.directory / f"step={step:08d}.ckpt"
        tmp = final.with_name(files.TMP_PREFIX + final.name)
        meta = self._metadata(trainer, pl_module)
        future = self._write(trainer, tmp)
        self._pending = (tmp, final, meta, future)
        self._last_saved_step, self._last_save_time = step, time.monotonic()
        if future is None and not self._sharded_async(trainer):
            self._finish_pending(trainer)

    def _sharded_async(self, trainer) -> bool:
        return self.async_save and hasattr(trainer.strategy, "wait_for_checkpoint")

    def _write(self, trainer: L.Trainer, tmp: Path) -> Future | None:
        strategy = trainer.strategy
        if self._sharded_async(trainer):
            strategy.async_checkpointing = True
            try:
                trainer.save_checkpoint(tmp)
            finally:
                strategy.async_checkpointing = False
            return None
        if not self.async_save:
            trainer.save_checkpoint(tmp)
            return None
        # Single-file async: stage a host copy now (the only stall), write it in the background.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if not trainer.is_global_zero:
            return None
        staged = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))
        self._writer = self._writer or ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        final = tmp.with_name(tmp.name[len(files.TMP_PREFIX) :])
        meta, resumed = self._metadata(trainer, trainer.lightning_module), trainer.ckpt_path

        def write_and_commit() -> None:
            torch.save(staged, tmp)
            self._commit(resumed, tmp, final, meta)

        return self._writer.submit(write_and_commit)

    def _finish_pending(self, trainer: L.Trainer) -> None:
        """Wait for the pending save on every rank, then commit it and rotate (rank 0)."""
        if self._pending is None:
            return
        tmp, final, meta, future = self._pending
        self._pending = None
        if future is not None:  # single-file async: the writer thread also committed it
            future.result()
            return
        if self._sharded_async(trainer):
            trainer.strategy.wait_for_checkpoint()
        trainer.strategy.barrier("CheckpointRotation.commit")
        if trainer.is_global_zero:
            self._commit(trainer.ckpt_path, tmp, final, meta)
        trainer.strategy.barrier("CheckpointRotation.rotated")

    def _commit(self, resumed_from, tmp: Path, final: Path, meta: dict) -> None:
        """Rename into place, verify, write the marker, then delete what is no longer kept (rank 0)."""
        os.replace(tmp, final)
        files.verify(final, trial_load=self.verify_mode == "load")
        files.write_json_atomically(files.marker_path(final), meta)
        if "score" in meta:
            self.scores[final.name] = meta["score"]
        self._rotate(resumed_from)

    def _rotate(self, resumed_from) -> None:
        complete = files.complete_checkpoints(self.directory)
        keep = set(complete[-self.keep_last :])
        if self.keep_best:
            ranked = sorted((p for p in complete if p.name in self.scores), key=lambda p: self.scores[p.name],
                            reverse=self.mode == "max")
            keep |= set(ranked[: self.keep_best])
        resumed = Path(resumed_from).resolve() if resumed_from else None
        for path in complete:
            if path in keep or path.resolve() == resumed or path.resolve().parent != self.directory.resolve():
                continue
            files.remove(path)
            self.scores.pop(path.name, None)

    def _metadata(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        dims = getattr(trainer.strategy, "parallel_dims", None)
        layout = {"world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__}
        if dims is not None:
            layout.update(tp=dims.tp, pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
                          zero_stage=getattr(trainer.strategy, "zero_stage", None))
        loss = trainer.callback_metrics.get("train_loss")
        score = trainer.callback_metrics.get(self.monitor) if self.monitor else None
        return {
            "step": trainer.global_step, "epoch": trainer.current_epoch, "tokens_seen": self.tokens_seen,
            "layout": layout, "config": dict(pl_module.hparams), "wall_time": time.time(),
            "loss": float(loss) if loss is not None else None,
            **({"score": float(score)} if score is not None else {}),
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen, "scores": dict(self.scores), "dirpath": self.dirpath}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens_seen = state_dict.get("tokens_seen", 0)
        self.scores = dict(state_dict.get("scores", {}))


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / (files.TMP_PREFIX + "write-test")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"CheckpointRotation cannot write to {directory} ({err.strerror}); choose a writable dirpath."
        ) from err
