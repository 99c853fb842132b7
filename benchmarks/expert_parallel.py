"""Expert parallelism against tensor parallelism and ZeRO-3 alone on the same MoE model: step time and memory.

The reference model with mixture-of-experts blocks (``--preset``, default "small-moe": 8 experts, top 2, one shared)
trains under each layout on the same CPU ranks, in a shuffled order per round, on the same global batch (8 sequences
a step: 4 per data-parallel rank under ep2 and ZeRO-3, 8 for tp2's one replica). Per round: each layout's median step
time (warm-up steps dropped) and the ratio of the others' to ep2's; reported as median (min, max) over the rounds.
Memory is what each rank holds after training, measured from the tensors themselves: the local shards of the
parameters, the gradients and the optimizer state (bytes; the largest rank's), which is what the layouts trade.

    python benchmarks/expert_parallel.py --rounds 5
    python benchmarks/expert_parallel.py --quick      # smoke: tiny-moe, 6 steps, 2 rounds
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.distributed as dist
from _timing import StepTimer, alternate, median_after_warmup, ratios, spread

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.parallel.dtensor import local_tensor
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed

LAYOUTS = {
    "ep2": {"expert_parallel_size": 2, "zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "zero3": {"zero_stage": 3},
}
GLOBAL_BATCH = 8  # sequences per step in every layout: 4 per data-parallel rank, 8 for tp2's single replica


def held_bytes(module: L.LightningModule, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards only)."""
    tensors = [local_tensor(p) for p in module.parameters()]
    tensors += [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    tensors += [local_tensor(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _fit(layout: str, preset: str, steps: int, seq_len: int, results: dict) -> float:
    torch.manual_seed(0)
    timer = StepTimer()
    trainer = cpu_trainer(
        strategy=LLMParallelStrategy(**LAYOUTS[layout]),
        devices=2,
        limit_val_batches=0,
        max_steps=steps,
        callbacks=[timer],
    )
    module = CausalLM(preset, warmup_steps=1)
    data_parallel = 1 if "tensor_parallel_size" in LAYOUTS[layout] else 2
    trainer.fit(module, LLMDataModule(num_tokens=100_000, seq_len=seq_len, batch_size=GLOBAL_BATCH // data_parallel))
    held = torch.tensor(held_bytes(module, trainer.optimizers[0]))
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    results[layout] = int(held)
    return median_after_warmup(timer.times, 2)


def rounds(preset: str, steps: int, seq_len: int, n_rounds: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    held: dict[str, int] = {}
    times = alternate(list(LAYOUTS), lambda layout: _fit(layout, preset, steps, seq_len, held), n_rounds)
    return times, held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small-moe")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke: tiny-moe, 6 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.rounds, args.seq_len = "tiny-moe", 6, 2, 64
    times, held = run_distributed(rounds, 2, args.preset, args.steps, args.seq_len, args.rounds, timeout=3600)[0]
    print(
        f"2 CPU ranks, preset={args.preset}, global batch {GLOBAL_BATCH} x {args.seq_len} per step, {args.steps} steps, "
        f"{args.rounds} rounds"
    )
    for layout in LAYOUTS:
        print(
            f"{layout}: median step per round, ms {[round(t * 1e3, 1) for t in times[layout]]}; "
            f"held per rank {held[layout] / 2**20:.2f} MiB (parameters + gradients + optimizer state)"
        )
    for layout in ("tp2", "zero3"):
        print(f"step time {layout} / ep2: {spread(ratios(times[layout], times['ep2']))}")


if __name__ == "__main__":
    main()
