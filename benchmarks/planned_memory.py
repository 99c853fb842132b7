"""The memory planner's per-GPU estimate for the MFU benchmark's runs, to compare with their measured peak.

One process, ZeRO 0 (nothing to shard), the reference model on the meta device (nothing allocated):
parameters + gradients + AdamW state from the byte table, activations from one fake-tensor forward, planned
per checkpointing policy as the strategy's planner does (``zero_auto.model_footprint``).
``benchmarks/gpu_suite.sh`` prints it next to ``mfu.py``'s measured peak; a gap above 10% means the
planner's tables need updating.

    python benchmarks/planned_memory.py --size 1B --precision bf16-mixed --batch 4 --seq-len 2048 --ac selective
"""

from __future__ import annotations

import argparse

import torch

from lightning_llm.modeling.activations import parameter_counts
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.planning.memory import model_state_bytes
from lightning_llm.strategies.zero_auto import model_footprint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    with torch.device("meta"):
        module = CausalLM(LlamaConfig.from_name(args.size, max_seq_len=args.seq_len))
        module.configure_model()
    total, largest, _ = parameter_counts(module)
    params, grads, optimizer = model_state_bytes(
        total, zero_stage=0, dp=1, precision=args.precision, largest_block_params=largest
    )
    footprint = model_footprint(module, micro_batch_size=args.batch, seq_len=args.seq_len, precision=args.precision)
    activations = footprint.activations_for(args.ac)
    gib = 2**30
    print(
        f"planned: params {params / gib:.2f} GiB, grads {grads / gib:.2f} GiB, optimizer {optimizer / gib:.2f} GiB, "
        f"activations {activations / gib:.2f} GiB, total {(params + grads + optimizer + activations) / gib:.2f} GiB"
    )


if __name__ == "__main__":
    main()
