"""Peak host memory (RSS) of each rank while ``LLMParallelStrategy`` or ``LLMDeepSpeedStrategy`` (ZeRO 3) builds,
shards and initializes a model.

Used by ``benchmarks/setup_memory.py`` and its tests: the model is created in ``configure_model`` on the meta
device (then sharded by FSDP2 under LLMParallelStrategy, or given only this rank's ZeRO-3 partitions under
DeepSpeed), so a rank's peak should be its own shard plus a bounded transient, never the whole model.
"""

from __future__ import annotations

import os
import threading
import time

import lightning as L
import psutil
import torch
from torch.distributed.tensor import DTensor

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing.trainer import cpu_trainer


class _RSSSampler(L.Callback):
    """Samples this process's RSS every few milliseconds from the ``setup`` hook (process group up) to ``on_fit_start``."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self.baseline = interval, 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, process.memory_info().rss)
            time.sleep(self.interval)

    def mark(self) -> int:
        """The peak so far (e.g. once the model is built and initialized, before DeepSpeed builds its engine)."""
        return max(self.peak, psutil.Process().memory_info().rss) - self.baseline

    def setup(self, trainer, pl_module, stage) -> None:
        self.baseline = self.peak = psutil.Process().memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def on_fit_start(self, trainer, pl_module) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


def _local_bytes(module) -> int:
    total = 0
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else getattr(p, "ds_tensor", None)
        local = p if local is None else local
        total += local.numel() * local.element_size()
    return total


def _numel(param) -> int:
    return getattr(param, "ds_numel", param.numel())  # a DTensor's numel is its global size


def measure_setup_memory(
    config: LlamaConfig, zero_stage: int = 3, empty_init: bool | None = None, strategy: str = "parallel"
) -> dict[str, int]:
    """On one rank: build ``CausalLM(config)`` through ``Trainer.fit`` (no step) and report bytes.

    Returns ``peak`` (RSS increase during setup), ``shard`` (this rank's parameter bytes), ``block``
    (one whole transformer block's bytes) and ``model`` (the whole model's bytes). ``empty_init=False``
    restores eager construction (the whole model on every rank) for comparison. ``strategy="deepspeed"``
    measures ``LLMDeepSpeedStrategy`` and adds ``built``: the peak once the model is built and initialized,
    before DeepSpeed's engine allocates its fp32 partitions and buffers.
    """
    torch.manual_seed(0)
    module, sampler = _EagerCausalLM(config, empty_init), _RSSSampler()
    marks: dict[str, int] = {}
    if strategy == "deepspeed":
        chosen = _marked_deepspeed()(
            sampler,
            marks,
            zero_stage=zero_stage,
            config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        )
    elif strategy == "parallel":
        chosen = LLMParallelStrategy(zero_stage=zero_stage)
    else:
        raise ValueError(f"strategy={strategy!r}; choose 'parallel' or 'deepspeed'.")
    trainer = cpu_trainer(
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=chosen,
        max_steps=0,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[sampler],
    )
    trainer.fit(module, LLMDataModule(num_tokens=2000, seq_len=16, batch_size=2, seed=0))
    block = sum(_numel(p) for p in module.model.layers[0].parameters())
    model = sum(_numel(p) for p in module.model.parameters())
    return {
        "peak": sampler.peak - sampler.baseline,
        "shard": _local_bytes(module.model),
        "block": 4 * block,
        "model": 4 * model,
        **marks,
    }


def _marked_deepspeed():
    """LLMDeepSpeedStrategy that notes the peak before its engine is built (imported here: DeepSpeed is optional)."""
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    class MarkedDeepSpeed(LLMDeepSpeedStrategy):
        """Notes the RSS peak between the model's init and the engine (the bucket sizing runs in between)."""

        def __init__(self, sampler: _RSSSampler, marks: dict, **kwargs) -> None:
            super().__init__(**kwargs)
            self.sampler, self.marks = sampler, marks

        def _size_buckets_to_model(self) -> None:
            self.marks["built"] = self.sampler.mark()
            super()._size_buckets_to_model()

    return MarkedDeepSpeed


class _EagerCausalLM(CausalLM):
    """CausalLM whose ``configure_model`` can opt out of the meta device (``empty_init=False``), for the 'before' row."""

    def __init__(self, config: LlamaConfig, empty_init: bool | None) -> None:
        super().__init__(config)
        self.empty_init = empty_init

    def configure_model(self) -> None:
        if self.empty_init is False and self.model is None:
            with torch.device("cpu"):
                from lightning_llm.models.llama import Llama

                self.model = Llama(self.config)
            return
        super().configure_model()
