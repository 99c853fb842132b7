"""Helpers for testing distributed training on CPU."""

from lightning_llm.testing.distributed import DistributedTestError, free_port, run_distributed

__all__ = ["DistributedTestError", "free_port", "run_distributed"]
