"""MFUMonitor: tokens/s, samples/s, TFLOP/s per device and model FLOPs utilisation, under any layout."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_llm.callbacks import cadence
from lightning_llm.contract import contract_of
from lightning_llm.data.batch import batch_tokens
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.planning.flops import device_peak_flops
from lightning_llm.validation import check_bool, check_float, check_int


# Lightning's ThroughputMonitor/Throughput are not used for the rates: they multiply per-device rates
# by the world size (counting a tensor- or pipeline-parallel batch once per rank) and synchronise the
# device after every batch. Their peak table (get_available_flops) is the fallback for unknown cards.
class MFUMonitor(L.Callback):
    """Logs throughput and MFU every ``log_every_n_steps`` optimizer steps, through every configured logger.

    FLOPs per token come from the model (``6 N + 12 L H d_head T``, see
    :mod:`lightning_llm.planning.flops`); under LLMParallelStrategy from the whole model before it was
    sharded or cut into pipeline stages. Tokens are counted once per data-parallel replica. Timing
    spans the steps between two logging steps and the device is synchronised only on logging steps,
    so the steps in between run without any added host-device synchronisation.

    Logged under the names Lightning's ``ThroughputMonitor`` gives the same quantities: ``train/samples_per_sec``,
    ``train/items_per_sec`` (tokens: ThroughputMonitor's items are what its ``length_fn`` counts) and
    ``train/flops_per_sec`` (whole job), ``train/device/flops_per_sec`` (model FLOP/s of one device) and
    ``train/device/mfu``; and, when activation checkpointing recomputes, ``train/device/hfu`` (hardware FLOPs
    including recomputation). The progress bar shows tokens/s and MFU as ``tok/s`` and ``mfu``. MFU needs a peak: the
    table in ``lightning_llm.planning.flops.PEAK_FLOPS``, Lightning's for other cards, or ``peak_flops``.

    Arguments:
        log_every_n_steps: optimizer steps between logs (the first log comes after the first window); default:
            the Trainer's (see :mod:`~lightning_llm.callbacks.cadence`).
        peak_flops: peak FLOP/s of one device, overriding the table (e.g. 989e12).
        flops_per_token: model FLOPs per token, overriding the automatic count.
        shifted_targets: batches hold seq_len + 1 tokens per sample (inputs plus the shifted target).
        prog_bar: also show tokens/s and MFU in the progress bar.

    Example::

        trainer = L.Trainer(callbacks=[MFUMonitor(log_every_n_steps=20)], logger=WandbLogger(project="llm"))
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
        flops_per_token: float | None = None,
        shifted_targets: bool = True,
        prog_bar: bool = True,
    ) -> None:
        check_int("log_every_n_steps", log_every_n_steps, minimum=1, optional=True)
        check_float("peak_flops", peak_flops, optional=True)
        check_float("flops_per_token", flops_per_token, minimum=0, inclusive=False, optional=True)
        check_bool("shifted_targets", shifted_targets)
        check_bool("prog_bar", prog_bar)
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops={peak_flops} must be positive (FLOP/s of one device, e.g. 989e12).")
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops = peak_flops
        self.flops_per_token = flops_per_token
        self.shifted_targets = shifted_targets
        self.prog_bar = prog_bar
        self._shape: ModelShape | None = None
        self._policies: list[str] = []
        self._last_step = 0
        self._dp = 1
        self._reset_window(None)

    def _reset_window(self, start: float | None) -> None:
        self._window_start, self._samples, self._tokens, self._seq_len = start, 0, 0, 0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cadence.check_multiple(trainer, self.log_every_n_steps, type(self).__name__)
        self._last_step = trainer.global_step
        strategy, contract = trainer.strategy, contract_of(trainer)
        self._shape = contract.model_shape
        if self._shape is None and not self.flops_per_token:
            raise ValueError(
                f"MFUMonitor cannot read the shape of {type(pl_module).__name__} (no transformer-block list found); "
                "pass flops_per_token=<model FLOPs per trained token>."
            )
        self._policies = contract.activation_checkpointing_policies
        self._dp = contract.layout.dp
        if self.peak_flops is None:
            self.peak_flops = device_peak_flops(strategy.root_device, str(trainer.precision))
            if self.peak_flops is None:
                rank_zero_warn(
                    f"MFUMonitor: no peak FLOP/s known for {strategy.root_device}; pass peak_flops to log MFU."
                )

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._window_start is None:
            self._window_start = self._now(trainer)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        samples, tokens = batch_tokens(batch, self.shifted_targets)
        self._samples += samples
        self._tokens += tokens
        self._seq_len = tokens // max(samples, 1)
        stepped, self._last_step = trainer.global_step != self._last_step, trainer.global_step
        if stepped and cadence.due(trainer, self.log_every_n_steps, counted=True):
            self._log(trainer, pl_module)

    def _now(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = self._now(trainer)
        elapsed = now - self._window_start
        dp, world = self._dp, trainer.world_size
        groups = contract_of(trainer).replica_groups  # the job's other launches (fault-tolerant replica groups)
        tokens_per_sec = self._tokens * dp / elapsed  # this launch's
        metrics = {
            "train/items_per_sec": tokens_per_sec * groups,
            "train/samples_per_sec": self._samples * dp / elapsed * groups,
        }
        flops_per_token = self.flops_per_token or self._shape.flops_per_token(self._seq_len)
        model_flops = tokens_per_sec * flops_per_token / world
        metrics["train/flops_per_sec"] = model_flops * world * groups
        metrics["train/device/flops_per_sec"] = model_flops
        if self.peak_flops:
            metrics["train/device/mfu"] = model_flops / self.peak_flops
            if self._shape is not None and any(p == "full" for p in self._policies):
                recompute = self._shape.recompute_flops_per_token(self._seq_len, self._policies)
                metrics["train/device/hfu"] = tokens_per_sec * (flops_per_token + recompute) / world / self.peak_flops
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)
        shown = {"tok/s": "train/items_per_sec", "mfu": "train/device/mfu"} if self.prog_bar else {}
        for short, name in shown.items():  # short names: the bar has no room for the loggers' keys
            if name in metrics:
                pl_module.log(short, metrics[name], prog_bar=True, logger=False, on_step=True, on_epoch=False)
        self._reset_window(now)
