"""How long a checkpoint save stalls training: synchronous against asynchronous CheckpointRotation, one run.

Times the step in which a save happens minus the median step without one, over several saves each,
alternating between the two modes. Single process, a ~12M-parameter model (~93 MB checkpoints).

    python benchmarks/checkpoint_stall.py --saves 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning as L
import torch

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig


class StepTimer(L.Callback):
    """Intervals between consecutive batch starts: each holds a step and whatever ran after it (a save).

    Lightning runs checkpoint callbacks after all others, so timing one hook pair would miss the save.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start: float | None = None

    def on_train_batch_start(self, *args) -> None:
        now = time.perf_counter()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now


def stalls(async_save: bool, saves: int, every: int) -> list[float]:
    torch.manual_seed(0)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as directory:
        rotation = CheckpointRotation(dirpath=directory, every_n_train_steps=every, keep_last=2, async_save=async_save)
        trainer = L.Trainer(accelerator="cpu", max_steps=saves * every, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[rotation, timer], limit_val_batches=0)
        config = LlamaConfig.from_name("small", dim=512, n_heads=8, n_kv_heads=4)
        trainer.fit(CausalLM(config), LLMDataModule(num_tokens=100_000, seq_len=64, batch_size=4))
    plain = statistics.median(t for i, t in enumerate(timer.times) if (i + 1) % every)
    return [t - plain for i, t in enumerate(timer.times) if (i + 1) % every == 0][:-1]  # the last save also waits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = {False: [], True: []}
    for _ in range(args.rounds):
        for mode in results:
            results[mode] += stalls(mode, args.saves, args.every)
    sync, asynchronous = statistics.median(results[False]), statistics.median(results[True])
    print(f"stall per save (median of {len(results[True])}): sync {sync * 1e3:.0f} ms, async {asynchronous * 1e3:.0f} ms, "
          f"ratio {asynchronous / sync:.2f}")


if __name__ == "__main__":
    main()
