"""Step time of gradient accumulation under ZeRO 3 with each ``accumulation_sync`` mode, alternated in one run.

"every_micro_batch" (the default at ZeRO 1-3) reduce-scatters every micro-batch, so gradients stay sharded;
"last_micro_batch" reduces once per optimizer step but holds the whole gradients meanwhile. Both trainers run
on the same ranks, in a shuffled order per round; each round gives the ratio of the two runs' median times per
optimizer step (all its micro-batches), reported as median (min, max) over the rounds.

    python benchmarks/accumulation_sync.py --ranks 2 --preset small --accumulate 4 --steps 12 --rounds 5
    python benchmarks/accumulation_sync.py --quick      # smoke: tiny preset, 2 rounds
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from _timing import alternate, median_after_warmup, ratios, spread

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed

MODES = ("every_micro_batch", "last_micro_batch")


class OptimizerStepTimer(L.Callback):
    """Wall time from one optimizer step's end to the next: every micro-batch of a step, the step itself."""

    def __init__(self, accumulate: int) -> None:
        self.times: list[float] = []
        self.accumulate, self._last = accumulate, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.accumulate:  # a micro-batch before the step's last
            return
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def _fit(mode: str, world_size: int, preset: str, steps: int, accumulate: int) -> float:
    torch.manual_seed(0)
    timer = OptimizerStepTimer(accumulate)
    trainer = cpu_trainer(
        strategy=LLMParallelStrategy(zero_stage=3, accumulation_sync=mode),
        devices=world_size,
        limit_val_batches=0,
        max_steps=steps,
        callbacks=[timer],
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(CausalLM(preset), LLMDataModule(num_tokens=200_000, seq_len=128, batch_size=2))
    return median_after_warmup(timer.times, 2)


def rounds(world_size: int, preset: str, steps: int, accumulate: int, n_rounds: int) -> dict[str, list[float]]:
    """Median optimizer-step time of each mode, per round (every rank runs the same seeded order)."""
    return alternate(MODES, lambda mode: _fit(mode, world_size, preset, steps, accumulate), n_rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke: tiny preset, 5 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.rounds = "tiny", 5, 2
    times = run_distributed(
        rounds, args.ranks, args.ranks, args.preset, args.steps, args.accumulate, args.rounds, timeout=1800
    )[0]
    print(
        f"{args.ranks} CPU ranks, preset={args.preset}, ZeRO-3, accumulate_grad_batches={args.accumulate}, "
        f"{args.steps} optimizer steps per run, {args.rounds} rounds"
    )
    for mode in MODES:
        print(f"median optimizer step per round, ms, {mode}: {[round(t * 1e3, 1) for t in times[mode]]}")
    ratio = spread(ratios(times["every_micro_batch"], times["last_micro_batch"]))
    print(f"ratio every_micro_batch / last_micro_batch: {ratio}")


if __name__ == "__main__":
    main()
