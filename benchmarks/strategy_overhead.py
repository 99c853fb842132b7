"""Step time of LLMParallelStrategy against Lightning's ModelParallelStrategy with a hand-written
``configure_model`` doing the same parallelization (fully_shard per block, then the model), in one run.

Both trainers alternate round by round on the same ranks; the ratio is of median step times.

    python benchmarks/strategy_overhead.py --ranks 2 --preset small --steps 30 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from _timing import StepTimer
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed


class HandParallelCausalLM(CausalLM):
    """What a Lightning user writes today for ModelParallelStrategy: FSDP2 by hand."""

    def configure_model(self) -> None:
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)


def _fit(kind: str, world_size: int, preset: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    if kind == "ours":
        model, strategy = CausalLM(preset), LLMParallelStrategy(zero_stage=3)
    else:
        model, strategy = HandParallelCausalLM(preset), ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        limit_val_batches=0,
    )
    trainer.fit(model, LLMDataModule(num_tokens=200_000, seq_len=128, batch_size=4))
    return timer.times[3:]  # the first steps include lazy initialisation


def rounds(world_size: int, preset: str, steps: int, n_rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"ours": [], "lightning": []}
    for _ in range(n_rounds):
        for kind in times:
            times[kind] += _fit(kind, world_size, preset, steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times = run_distributed(rounds, args.ranks, args.ranks, args.preset, args.steps, args.rounds, timeout=1800)[0]
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["lightning"])
    print(f"{args.ranks} CPU ranks, preset={args.preset}, ZeRO-3, {len(times['ours'])} steps each")
    print(f"median step: LLMParallelStrategy {ours * 1e3:.2f} ms, ModelParallelStrategy + hand-written FSDP2 "
          f"{theirs * 1e3:.2f} ms, ratio {ours / theirs:.3f}")


if __name__ == "__main__":
    main()
