"""Which package files a tp2 x ZeRO-3 setup runs, and how often it looks for the blocks.

A profiler hook (``sys.setprofile``) records every Python function entered from the callbacks' ``setup`` hook to
``on_fit_start`` (configure_model, the strategy's ``setup``: plan, split, shard, materialize), on each of 4 CPU
ranks (tp=2, dp=2, ZeRO 3, the tiny reference Llama). Prints, for rank 0, the number of package files and calls of
:func:`lightning_llm.modeling.blocks.find_blocks` and the model-reading entry points, and the files by sub-package;
then the files tensor parallelism's plan passes through: those entered while a function of ``parallel/tp/`` called
from outside it runs (planning the whole model, applying the plan, its first-forward hooks set up).

    python benchmarks/setup_files.py
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import lightning as L
import torch

PACKAGE = str(Path(__file__).resolve().parents[1] / "lightning_llm")
TP = os.path.join(PACKAGE, "parallel", "tp")
COUNTED = ("find_blocks", "traced_blocks", "block_modules")


class SetupProfile(L.Callback):
    """Files and call counts of the package's code run between ``setup`` and ``on_fit_start``."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.calls: collections.Counter = collections.Counter()
        self.tp_files: set[str] = set()
        self._tp_frames: list = []  # the open calls into parallel/tp/ from outside it

    def _record(self, frame, event, arg) -> None:
        filename = frame.f_code.co_filename
        if event == "call" and filename.startswith(PACKAGE):
            self.files.add(os.path.relpath(filename, PACKAGE))
            if frame.f_code.co_name in COUNTED:
                self.calls[frame.f_code.co_name] += 1
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if filename.startswith(TP) and not caller.startswith(TP):
                self._tp_frames.append(frame)
            if self._tp_frames:
                self.tp_files.add(os.path.relpath(filename, PACKAGE))
        elif event == "return" and self._tp_frames and frame is self._tp_frames[-1]:
            self._tp_frames.pop()

    def setup(self, trainer, pl_module, stage) -> None:
        sys.setprofile(self._record)

    def on_fit_start(self, trainer, pl_module) -> None:
        sys.setprofile(None)


def _rank() -> tuple[list[str], dict[str, int]]:
    from lightning_llm import LLMParallelStrategy
    from lightning_llm.data import LLMDataModule
    from lightning_llm.models import CausalLM, LlamaConfig
    from lightning_llm.testing import cpu_trainer

    torch.manual_seed(0)
    profile = SetupProfile()
    strategy = LLMParallelStrategy(tensor_parallel_size=2, zero_stage=3)
    trainer = cpu_trainer(devices=4, strategy=strategy, max_steps=1, callbacks=[profile])
    model = CausalLM(LlamaConfig.from_name("tiny", n_layers=2), max_steps=1)
    trainer.fit(model, LLMDataModule(num_tokens=20_000, seq_len=16, batch_size=2))
    return sorted(profile.files), dict(profile.calls), sorted(profile.tp_files)


def main() -> None:
    from lightning_llm.testing import run_distributed

    files, calls, tp_files = run_distributed(_rank, 4, timeout=300)[0]
    by_package = collections.Counter(f.split("/")[0] if "/" in f else "." for f in files)
    print(f"package files run by a tp2 x ZeRO-3 setup (rank 0): {len(files)}")
    print(f"calls: {calls}")
    print(f"by sub-package: {dict(sorted(by_package.items()))}")
    for name in files:
        print(f"  {name}")
    print(f"package files tensor parallelism's plan passes through (rank 0): {len(tp_files)}")
    for name in tp_files:
        print(f"  {name}")


if __name__ == "__main__":
    main()
