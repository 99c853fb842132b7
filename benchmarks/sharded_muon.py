"""Optimizer-step time of ShardedMuon against torch.optim.Muon under FSDP2 (ZeRO-3) and tensor parallelism.

torch's Muon orthogonalizes every matrix on every rank of its mesh; ShardedMuon gathers each matrix, orthogonalizes
it on one rank and scatters the result. Both optimize the same hidden matrices (embeddings, head and norms are
frozen here, so nothing else is timed), fp32 model, bf16 Newton-Schulz (both optimizers' default). The time is
from ``on_before_optimizer_step`` (after backward) to the batch's end: the optimizer step itself. Sides alternate
per round in a shuffled order; per-round ratio of median step times, median (min, max) over the rounds.

    python benchmarks/sharded_muon.py --ranks 2 --preset small --steps 8 --rounds 5
    python benchmarks/sharded_muon.py --quick      # smoke: tiny preset, 2 rounds
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from _timing import alternate, median_after_warmup, ratios, spread

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.optim import ShardedMuon, muon_param_groups
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed

SIDES = ("sharded", "torch")
LAYOUTS = {"zero3": {"zero_stage": 3}, "tp2": {"tensor_parallel_size": 2}}


class MuonOnly(CausalLM):
    """The reference model with only its hidden matrices trainable, optimized by one of the two Muons."""

    def __init__(self, preset: str, side: str) -> None:
        super().__init__(preset)
        self.side = side

    def configure_model(self) -> None:
        super().configure_model()
        hidden = {id(p) for p in muon_param_groups(self)[0]["params"]}
        for p in self.parameters():
            p.requires_grad_(id(p) in hidden)

    def configure_optimizers(self):
        hidden = [p for p in self.parameters() if p.requires_grad]
        return ShardedMuon(hidden, lr=0.02) if self.side == "sharded" else torch.optim.Muon(hidden, lr=0.02)


class OptimizerStepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)


def _fit(side: str, layout: str, world_size: int, preset: str, steps: int) -> float:
    torch.manual_seed(0)
    timer = OptimizerStepTimer()
    trainer = cpu_trainer(
        strategy=LLMParallelStrategy(**LAYOUTS[layout]),
        devices=world_size,
        limit_val_batches=0,
        max_steps=steps,
        callbacks=[timer],
    )
    trainer.fit(MuonOnly(preset, side), LLMDataModule(num_tokens=100_000, seq_len=64, batch_size=2))
    return median_after_warmup(timer.times, 2)


def rounds(world_size: int, preset: str, steps: int, n_rounds: int) -> dict[str, dict[str, list[float]]]:
    return {
        layout: alternate(SIDES, lambda side: _fit(side, layout, world_size, preset, steps), n_rounds)
        for layout in LAYOUTS
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke: tiny preset, 4 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.rounds = "tiny", 4, 2
    times = run_distributed(rounds, args.ranks, args.ranks, args.preset, args.steps, args.rounds, timeout=3600)[0]
    print(f"{args.ranks} CPU ranks, preset={args.preset}, {args.steps} steps per run, {args.rounds} rounds")
    for layout, sides in times.items():
        for side in SIDES:
            print(f"{layout} median optimizer step per round, ms, {side}: {[round(t * 1e3, 1) for t in sides[side]]}")
        print(f"{layout} optimizer step sharded / torch: {spread(ratios(sides['sharded'], sides['torch']))}")


if __name__ == "__main__":
    main()
