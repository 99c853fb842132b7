"""Step time of LLMParallelStrategy against Lightning's ModelParallelStrategy with a hand-written
``configure_model`` doing the same parallelization (fully_shard per block, then the model), in one run.

Both trainers alternate round by round on the same ranks (shuffled order per round); each round gives
the ratio of the two runs' median step times, reported as median (min, max) over the rounds.

    python benchmarks/strategy_overhead.py --ranks 2 --preset small --steps 30 --rounds 7
    python benchmarks/strategy_overhead.py --quick      # CI smoke: tiny preset, 2 rounds
"""

from __future__ import annotations

import argparse

import torch
from _timing import StepTimer, alternate, median_after_warmup, ratios, spread
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed


class HandParallelCausalLM(CausalLM):
    """What a Lightning user writes today for ModelParallelStrategy: FSDP2 by hand."""

    def configure_model(self) -> None:
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)


def _fit(kind: str, world_size: int, preset: str, steps: int) -> float:
    torch.manual_seed(0)
    if kind == "ours":
        model, strategy = CausalLM(preset), LLMParallelStrategy(zero_stage=3)
    else:
        model, strategy = (
            HandParallelCausalLM(preset),
            ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
        )
    timer = StepTimer()
    trainer = cpu_trainer(
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        callbacks=[timer],
        limit_val_batches=0,
    )
    trainer.fit(model, LLMDataModule(num_tokens=200_000, seq_len=128, batch_size=4))
    return median_after_warmup(timer.times, 3)  # the first steps include lazy initialisation


def rounds(world_size: int, preset: str, steps: int, n_rounds: int) -> dict[str, list[float]]:
    """Median step time of each side, per round (every rank runs the same seeded order)."""
    return alternate(["ours", "lightning"], lambda kind: _fit(kind, world_size, preset, steps), n_rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny preset, 8 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.rounds = "tiny", 8, 2
    times = run_distributed(rounds, args.ranks, args.ranks, args.preset, args.steps, args.rounds, timeout=1800)[0]
    print(f"{args.ranks} CPU ranks, preset={args.preset}, ZeRO-3, {args.steps} steps per run, {args.rounds} rounds")
    print(
        f"median step per round, ms: LLMParallelStrategy {[round(t * 1e3, 1) for t in times['ours']]}, "
        f"ModelParallelStrategy + hand-written FSDP2 {[round(t * 1e3, 1) for t in times['lightning']]}"
    )
    print(f"ratio LLMParallelStrategy / hand-written: {spread(ratios(times['ours'], times['lightning']))}")


if __name__ == "__main__":
    main()
