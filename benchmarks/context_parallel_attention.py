"""Context-parallel attention on 2 CPU gloo ranks: all-gather vs send/recv ring vs Ulysses, forward + backward.

Usage::

    python benchmarks/context_parallel_attention.py --seq-lens 2048 8192 --rounds 5

One (batch 1, 8 query heads, 2 key/value heads, head_dim 64) causal attention per side and round, sides alternated
in a shuffled order per round (:func:`_timing.alternate`); seconds per forward + backward quoted as median (min,
max). A shared machine's noise shows in the spread: compare medians only where the ranges do not overlap.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _timing import alternate, spread

from lightning_llm.testing import run_distributed


def _measure(seq_lens: list[int], rounds: int) -> dict:
    from lightning_llm.parallel.cp import CPGroup, context_parallel_attention, ring_attention
    from lightning_llm.parallel.cp.ulysses import ulysses_attention

    dist.init_process_group("gloo")
    cp = CPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    sides = {"allgather": context_parallel_attention, "ring": ring_attention, "ulysses": ulysses_attention}
    results = {}
    for seq in seq_lens:
        n = seq // cp.size
        q, k, v = (torch.randn(1, h, n, 64, requires_grad=True) for h in (8, 2, 2))

        def run(side: str) -> float:
            dist.barrier()
            start = time.perf_counter()
            sides[side](q, k, v, cp, is_causal=True).sum().backward()
            dist.barrier()
            return time.perf_counter() - start

        results[seq] = alternate(list(sides), run, rounds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = run_distributed(_measure, 2, args.seq_lens, args.rounds, timeout=3600)[0]
    for seq, times in results.items():
        for side, values in times.items():
            print(f"seq {seq:>6} {side:>9}: {spread(values)} s per forward + backward")


if __name__ == "__main__":
    main()
