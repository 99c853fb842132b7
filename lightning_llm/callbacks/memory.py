"""MemoryMonitor: device memory (CUDA) or resident memory (CPU) each logging step; RunInfoLogger: the layout.

The memory keys follow torchtitan's: the peak allocated and reserved bytes since the last log, the
allocator's retries (a sign of fragmentation just short of an OOM) and OOMs. On CPU the process's
resident set size, now and at its peak, stands in.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import lightning as L
import torch
from typing_extensions import override

from lightning_llm.callbacks import cadence
from lightning_llm.contract import contract_of

GiB = 2**30


def rss_bytes() -> tuple[int, int]:
    """This process's resident set size now and at its peak, in bytes (Linux's ``/proc``; else getrusage's peak)."""
    status = Path("/proc/self/status")
    if status.exists():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return peak, peak


def memory_metrics(device: torch.device) -> dict[str, float]:
    """``memory/*`` values for ``device``; on CUDA the peaks are reset, so each log covers its own window.

    Example::

        memory_metrics(torch.device("cuda", 0))  # {'memory/max_allocated_gib': 61.2, ..., 'memory/num_ooms': 0}
    """
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        metrics = {
            "memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB,
            "memory/num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "memory/num_ooms": float(stats.get("num_ooms", 0)),
        }
        torch.cuda.reset_peak_memory_stats(device)
        return metrics
    now, peak = rss_bytes()
    return {"memory/rss_gib": now / GiB, "memory/max_rss_gib": peak / GiB}


class MemoryMonitor(L.Callback):
    """Logs :func:`~lightning_llm.callbacks.memory.memory_metrics` of this rank's device on the Trainer's logging steps.

    Example::

        trainer = L.Trainer(callbacks=[MemoryMonitor()], log_every_n_steps=10)
    """

    def __init__(self) -> None:
        self._last_step = -1  # an accumulation micro-batch ends with global_step unchanged: log once per step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if self._last_step != trainer.global_step and cadence.due(trainer, None, counted=True):
            self._last_step = trainer.global_step
            for name, value in memory_metrics(trainer.strategy.root_device).items():
                pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)


class RunInfoLogger(L.Callback):
    """Puts the parallel layout and the activation-checkpointing policies in every logger's hyperparameters.

    With W&B they land in the run config (``parallel/tp``, ``parallel/zero_stage``, ...), so runs can be
    filtered and grouped by layout. ``zero_stage="auto"`` adds its decision and plan table itself.

    Example::

        trainer = L.Trainer(strategy=LLMParallelStrategy(tensor_parallel_size=2), callbacks=[RunInfoLogger()])
    """

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        contract = contract_of(trainer)
        info = {f"parallel/{key}": value for key, value in contract.layout.as_dict().items()}
        info["parallel/activation_checkpointing"] = ",".join(contract.activation_checkpointing_policies) or "none"
        if contract.tensor_parallel_coverage:
            info["parallel/tp_coverage"] = " | ".join(contract.tensor_parallel_coverage)
        for logger in trainer.loggers:
            logger.log_hyperparams(info)
