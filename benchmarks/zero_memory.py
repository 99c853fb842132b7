"""Per-rank bytes of parameters, gradients and optimizer state for ZeRO 0-3, measured on CPU ranks.

Trains one step of the reference model on N gloo ranks with LLMParallelStrategy and sums the
bytes of the tensors each rank holds (local shards of DTensors) right after the optimizer step,
next to the ZeRO paper's formula for fp32 AdamW: params 4Ψ, gradients 4Ψ, states 8Ψ.

    python benchmarks/zero_memory.py --ranks 4 --preset small
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


class _Measure(L.Callback):
    def on_before_backward(self, trainer, pl_module, loss):
        # Between forward and backward: what FSDP2 keeps gathered (stages 1-2 keep every block).
        self.params_in_backward = _local_bytes(pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = list(pl_module.parameters())
        states = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        self.bytes = {
            "params": _local_bytes(params),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(states),
            "params_in_backward": self.params_in_backward,
        }


def measure(world_size: int, preset: str, zero_stage: int) -> dict:
    torch.manual_seed(0)
    measure_cb = _Measure()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=LLMParallelStrategy(zero_stage=zero_stage), max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[measure_cb], limit_val_batches=0,
    )
    model = CausalLM(preset, warmup_steps=1)
    trainer.fit(model, LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=2))
    return measure_cb.bytes


def sweep(world_size: int, preset: str) -> list[dict]:
    return [measure(world_size, preset, stage) for stage in (0, 1, 2, 3)]


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
    print(f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} {'ZeRO formula':>13} {'params fwd->bwd':>16}")
    for stage, row in enumerate(rows):
        mib = {k: v / 2**20 for k, v in row.items()}
        total = mib["params"] + mib["grads"] + mib["optimizer"]
        print(f"{stage:>5} {mib['params']:8.2f} {mib['grads']:8.2f} {mib['optimizer']:8.2f} {total:8.2f} "
              f"{formula[stage] / 2**20:13.2f} {mib['params_in_backward']:16.2f}")


if __name__ == "__main__":
    main()
