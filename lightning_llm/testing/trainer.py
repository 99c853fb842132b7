"""A Lightning Trainer for tests and benchmarks on the CPU: it trains, and prints or writes nothing else."""

from __future__ import annotations

from typing import Any

import lightning as L

QUIET = dict(
    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def cpu_trainer(**kwargs: Any) -> L.Trainer:
    """``L.Trainer(**kwargs)`` on the CPU without logger, checkpointing, progress bar or model summary.

    ``kwargs`` are the Trainer's own arguments and win over these defaults.

    Example::

        trainer = cpu_trainer(devices=2, strategy=LLMParallelStrategy(zero_stage=3), max_steps=10)
        trainer.fit(model, datamodule)
    """
    return L.Trainer(**{**QUIET, **kwargs})
