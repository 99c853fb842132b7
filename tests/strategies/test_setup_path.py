"""LLMParallelStrategy's setup looks for the model's blocks once and hands what it found to every later step.

Counted with a profiler hook between the callbacks' ``setup`` and ``on_fit_start`` (``benchmarks/setup_files.py``
does the same on 4 ranks under tp2 x ZeRO-3 and also counts the package files the setup runs).
"""

from __future__ import annotations

import collections
import sys

import lightning as L
import pytest
import torch

from lightning_llm import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
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


def _tp_plan_files() -> list[str]:
    """The package files entered while tensor parallelism's code runs (a function of ``parallel/tp/`` called from
    outside it, and everything it calls), in one tp2 setup of the reference model."""
    import os

    import lightning_llm
    from lightning_llm.data import LLMDataModule
    from lightning_llm.models import CausalLM, LlamaConfig

    package = os.path.dirname(lightning_llm.__file__)
    tp_dir, files, open_calls = os.path.join(package, "parallel", "tp"), set(), []

    def record(frame, event, arg) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package):
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if name.startswith(tp_dir) and not caller.startswith(tp_dir):
                open_calls.append(frame)
            if open_calls:
                files.add(os.path.relpath(name, package))
        elif event == "return" and open_calls and frame is open_calls[-1]:
            open_calls.pop()

    class Profile(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            sys.setprofile(record)

        def on_fit_start(self, trainer, pl_module) -> None:
            sys.setprofile(None)

    torch.manual_seed(0)
    strategy = LLMParallelStrategy(tensor_parallel_size=2, zero_stage=3)
    trainer = cpu_trainer(devices=2, strategy=strategy, max_steps=1, callbacks=[Profile()])
    try:
        model = CausalLM(LlamaConfig.from_name("tiny", n_layers=2), max_steps=1)
        trainer.fit(model, LLMDataModule(num_tokens=20_000, seq_len=16, batch_size=2))
    finally:
        sys.setprofile(None)
    return sorted(files)


@pytest.mark.timeout(180)
def test_tensor_parallels_plan_passes_through_no_more_files_than_before_the_structure_was_traced():
    # 21 at 5e935c3 (before the any-model-code work), with benchmarks/setup_files.py's hook on 4 ranks; 27 after
    # that work's first part.
    files = run_distributed(_tp_plan_files, 2, timeout=170)[0]
    assert len(files) <= 21, files
    assert any(f.startswith("parallel/tp/") for f in files)
