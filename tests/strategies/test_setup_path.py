"""LLMParallelStrategy's setup looks for the model's blocks once and hands what it found to every later step.

Counted with a profiler hook between the callbacks' ``setup`` and ``on_fit_start`` (``benchmarks/setup_files.py``
does the same on 4 ranks under tp2 x ZeRO-3 and also counts the package files the setup runs).
"""

from __future__ import annotations

import collections
import sys

import lightning as L
import torch

from lightning_llm import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer
from lightning_llm.testing.models import UserLM

SEARCHES = ("find_blocks", "traced_blocks")


class _CountCalls(L.Callback):
    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()

    def _record(self, frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_name in SEARCHES and "lightning_llm" in frame.f_code.co_filename:
            self.calls[frame.f_code.co_name] += 1

    def setup(self, trainer, pl_module, stage) -> None:
        sys.setprofile(self._record)

    def on_fit_start(self, trainer, pl_module) -> None:
        sys.setprofile(None)


def test_setup_reads_the_blocks_once():
    torch.manual_seed(0)
    counted = _CountCalls()
    strategy = LLMParallelStrategy(zero_stage=0, activation_checkpointing="full")  # AC planning reads blocks too
    trainer = cpu_trainer(devices=1, strategy=strategy, max_steps=1, callbacks=[counted])
    try:
        trainer.fit(UserLM(layers=2), torch.utils.data.DataLoader(torch.randint(0, 64, (4, 9)), batch_size=2))
    finally:
        sys.setprofile(None)  # a fit that fails before on_fit_start would leave the hook on for the session
    assert counted.calls == {"find_blocks": 1, "traced_blocks": 1}, counted.calls
