"""A sequence that does not fit one rank's memory without context parallelism trains with it (2 CPU gloo ranks).

Usage::

    python benchmarks/context_parallel_memory.py --seq-len 8192

Each rank caps its own heap (``RLIMIT_DATA``: every ``malloc``/anonymous ``mmap`` beyond it fails, as a GPU's
memory would) at the same number of bytes above what it holds before the Trainer starts, then trains the reference
model (4 blocks, dim 128) on one sequence per step for 2 steps with ``LLMParallelStrategy``: first uncapped at
C = 2 to measure what a rank needs (heap growth), then with the cap set 15% above that, at C = 1 (ZeRO 0, each
rank a whole sequence) and at C = 2 (each rank half of it). Prints each run's outcome and heap growth per rank.
"""

from __future__ import annotations

import argparse
import resource

import torch

from lightning_llm.testing import run_distributed

MiB = 2**20


def _heap_bytes() -> int:
    """This process's data segment (``VmData``: heap and anonymous mappings), in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmData"))
    return int(line.split()[1]) * 1024


def _train(cp: int, seq_len: int, cap: int | None) -> tuple[str, int]:
    from lightning_llm.models import CausalLM, LlamaConfig
    from lightning_llm.strategies import LLMParallelStrategy
    from lightning_llm.testing import cpu_trainer

    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny", vocab_size=64, dim=128, n_layers=4, ffn_hidden_dim=384, max_seq_len=seq_len)
    module = CausalLM(config, warmup_steps=1, max_steps=2)
    sequences = [torch.randint(0, 64, (seq_len + 1,)) for _ in range(4)]
    base = _heap_bytes()
    if cap is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (base + cap, resource.RLIM_INFINITY))
    try:
        strategy = LLMParallelStrategy(context_parallel_size=cp, zero_stage=0)
        cpu_trainer(devices=2, strategy=strategy, max_steps=2).fit(module, torch.utils.data.DataLoader(sequences))
        return "trained 2 steps", _heap_bytes() - base
    except RuntimeError as error:
        if "can't allocate memory" not in str(error):
            raise
        return "out of memory", _heap_bytes() - base
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args()
    needed = max(grown for _, grown in run_distributed(_train, 2, 2, args.seq_len, None, timeout=900))
    cap = int(needed * 1.15)
    print(f"seq {args.seq_len}: a rank needs {needed / MiB:.0f} MiB at C = 2; cap {cap / MiB:.0f} MiB per rank")
    for cp in (1, 2):
        ranks = run_distributed(_train, 2, cp, args.seq_len, cap, timeout=900)
        grown = ", ".join(f"{g / MiB:.0f}" for _, g in ranks)
        print(f"C = {cp} under the cap: {ranks[0][0]} (heap growth per rank {grown} MiB)")


if __name__ == "__main__":
    main()
