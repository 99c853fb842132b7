"""How long a checkpoint save stalls training: synchronous against asynchronous CheckpointRotation, one run.

The stall is the time the training loop spends between the end of a step and the start of the next
one: Lightning runs checkpoint callbacks after all others, so a timer callback's ``on_train_batch_end``
marks the end of the step and its ``on_train_batch_start`` the moment training goes on. On steps
without a save this gap is ~0; on save steps it is the save's blocking part (sync: dump, write,
verify, commit, rotate; async: dump and the host copy). Also printed: the whole run's time per
mode, since on a CPU-only machine the background writer competes with training for the same cores.
Single process, a ~12M-parameter model (~93 MB checkpoints with AdamW state), the modes alternate.

    python benchmarks/checkpoint_stall.py --saves 4 --every 3 --rounds 2
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


class StallTimer(L.Callback):
    """Gaps between the end of a step (before checkpoint callbacks run) and the start of the next."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._step_end: float | None = None

    def on_train_batch_end(self, *args) -> None:
        self._step_end = time.perf_counter()

    def on_train_batch_start(self, *args) -> None:
        if self._step_end is not None:
            self.gaps.append(time.perf_counter() - self._step_end)


def run(async_save: bool, saves: int, every: int) -> tuple[list[float], float, float]:
    """(stall of each save but the last, median gap of steps without a save, seconds for the whole fit)."""
    torch.manual_seed(0)
    timer = StallTimer()
    with tempfile.TemporaryDirectory() as directory:
        rotation = CheckpointRotation(dirpath=directory, every_n_train_steps=every, keep_last=2, async_save=async_save)
        trainer = L.Trainer(accelerator="cpu", max_steps=saves * every, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[rotation, timer], limit_val_batches=0)
        config = LlamaConfig.from_name("small", dim=512, n_heads=8, n_kv_heads=4)
        start = time.perf_counter()
        trainer.fit(CausalLM(config), LLMDataModule(num_tokens=100_000, seq_len=64, batch_size=4))
        total = time.perf_counter() - start
    # gap i follows step i + 1; the last step's save has no next step to delay
    saved = [gap for i, gap in enumerate(timer.gaps) if (i + 1) % every == 0]
    plain = statistics.median(gap for i, gap in enumerate(timer.gaps) if (i + 1) % every)
    return saved, plain, total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    stalls: dict[bool, list[float]] = {False: [], True: []}
    plains: dict[bool, list[float]] = {False: [], True: []}
    totals: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for mode in (False, True):
            saved, plain, total = run(mode, args.saves, args.every)
            stalls[mode] += saved
            plains[mode].append(plain)
            totals[mode].append(total)
    sync, asynchronous = statistics.median(stalls[False]), statistics.median(stalls[True])
    print(f"training stall per save (median of {len(stalls[True])} saves each): sync {sync * 1e3:.0f} ms, "
          f"async {asynchronous * 1e3:.0f} ms, ratio async/sync {asynchronous / sync:.3f} "
          f"(steps without a save: {max(plains[False] + plains[True]) * 1e3:.2f} ms at most)")
    print(f"whole run ({args.saves * args.every} steps, {args.saves} saves, median of {args.rounds}): "
          f"sync {statistics.median(totals[False]):.1f} s, async {statistics.median(totals[True]):.1f} s")


if __name__ == "__main__":
    main()
