"""Context parallelism's full training step on 2 CPU gloo ranks: ring vs Ulysses, alternated, at two lengths.

Usage::

    python benchmarks/context_parallel_step.py --seq-lens 2048 8192 --rounds 5

One reference model per method (4 blocks, dim 256, 8 query / 4 key-value heads, vocabulary 256), each made
context parallel over both ranks with ``parallelize`` (ZeRO 0), trains one sequence per step with AdamW: forward,
the user's loss on the gathered logits, backward (gradients all-reduced over the CP ranks) and the optimizer step.
Each round times one step of each method, in a shuffled order (:func:`_timing.alternate`), after a warm-up step;
seconds per step and the per-round Ulysses / ring ratio are quoted as median (min, max).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _timing import alternate, ratios, spread

from lightning_llm.testing import run_distributed

METHODS = ("ring", "ulysses")


def _model(method: str, seq_len: int):
    from lightning_llm.models import CausalLM, LlamaConfig
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize

    torch.manual_seed(0)
    config = LlamaConfig.from_name(
        "tiny", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden_dim=768, max_seq_len=seq_len
    )
    module = CausalLM(config)
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    dims = ParallelDims.for_world(dist.get_world_size(), cp=dist.get_world_size(), replicate_all=True)
    dims.build_mesh("cpu")
    parallelize(module, dims, zero_stage=0, context_parallel_method=method)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-4)


def _measure(seq_lens: list[int], rounds: int) -> dict:
    dist.init_process_group("gloo")
    results = {}
    for seq_len in seq_lens:
        models = {method: _model(method, seq_len) for method in METHODS}
        tokens = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))

        def step(method: str) -> float:
            module, optimizer = models[method]
            dist.barrier()
            start = time.perf_counter()
            module.training_step(tokens, 0).backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            return time.perf_counter() - start

        for method in METHODS:
            step(method)  # warm-up: allocator growth, first-call dispatch
        results[seq_len] = alternate(METHODS, step, rounds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = run_distributed(_measure, 2, args.seq_lens, args.rounds, timeout=3600)[0]
    for seq_len, times in results.items():
        for method in METHODS:
            print(f"seq {seq_len:>6} {method:>8}: {spread(times[method])} s per training step")
        print(f"seq {seq_len:>6} ulysses / ring: {spread(ratios(times['ulysses'], times['ring']))}")


if __name__ == "__main__":
    main()
