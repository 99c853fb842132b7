"""Run Lightning's own ``RunIf``-marked tests on CPU ranks.

Lightning's ``RunIf(min_cuda_gpus=N, standalone=True)`` tests run under ``torchrun`` on N GPUs. Here
the same mark means N gloo ranks on the CPU: ``conftest.py`` runs the test function on N spawned processes
(:func:`lightning_llm.testing.run_distributed`), each of which Lightning sees as externally launched.
Other ``RunIf`` conditions (minimum torch, Windows, bf16 on CUDA) hold on every machine CI uses.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest


def RunIf(min_cuda_gpus: int = 0, standalone: bool = False, **conditions: Any) -> pytest.MarkDecorator:
    """Lightning's test decorator: ``min_cuda_gpus=N`` becomes "run on N CPU ranks"; the rest always hold here."""
    del standalone, conditions  # torch >= 2.11, Linux, and bf16 works on CPU
    if min_cuda_gpus == 0:  # e.g. RunIf(bf16_cuda=True) on one parameter: the function's own mark decides the ranks
        return pytest.mark.lightning_condition
    return pytest.mark.lightning_ranks(min_cuda_gpus)


def call_test(module: str, name: str, kwargs: dict[str, Any]) -> None:
    """One rank's run of a test function (the spawned process imports the test module itself)."""
    getattr(importlib.import_module(module), name)(**kwargs)
