"""Helpers for testing distributed training on CPU."""

from lightning_llm.testing.distributed import DistributedTestError, NativeCrashRetried, free_port, run_distributed
from lightning_llm.testing.trainer import cpu_trainer

__all__ = ["DistributedTestError", "NativeCrashRetried", "cpu_trainer", "free_port", "run_distributed"]
