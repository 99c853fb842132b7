"""Per-rank bytes of parameters, gradients and optimizer state for ZeRO 0-3, measured on CPU ranks.

Trains one step of the reference model on N gloo ranks with LLMParallelStrategy and sums the
bytes of the tensors each rank holds (local shards of DTensors) right after the optimizer step,
next to the ZeRO paper's formula for fp32 AdamW: params 4Ψ, gradients 4Ψ, states 8Ψ.

    python benchmarks/zero_memory.py --ranks 4 --preset small
"""

from __future__ import annotations

import argparse

import torch

from lightning_llm.models import CausalLM
from lightning_llm.testing import run_distributed
from lightning_llm.testing.memory import measure_model_states


def sweep(world_size: int, preset: str) -> list[dict]:
    return [measure_model_states(world_size, preset, stage) for stage in (0, 1, 2, 3)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    with torch.device("meta"):
        model = CausalLM(args.preset)
        model.configure_model()
    psi = sum(p.numel() for p in model.parameters())
    n = args.ranks
    formula = {0: 16 * psi, 1: 4 * psi + 4 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}
    rows = run_distributed(sweep, n, n, args.preset, timeout=600)[0]
    print(f"preset={args.preset} Ψ={psi:,} parameters, {n} ranks, fp32 AdamW; MiB per rank after the optimizer step")
    print(
        f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} {'ZeRO formula':>13} {'params fwd->bwd':>16}"
    )
    for stage, row in enumerate(rows):
        mib = {k: v / 2**20 for k, v in row.items()}
        total = mib["params"] + mib["grads"] + mib["optimizer"]
        print(
            f"{stage:>5} {mib['params']:8.2f} {mib['grads']:8.2f} {mib['optimizer']:8.2f} {total:8.2f} "
            f"{formula[stage] / 2**20:13.2f} {mib['params_in_backward']:16.2f}"
        )


if __name__ == "__main__":
    main()
