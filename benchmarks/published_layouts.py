"""The planner on layouts that trained at scale: each must fit 80GB H100s, as it did for the people who ran it.

Planned on the meta device (nothing allocated, seconds on a laptop) with :func:`model_footprint` and
:func:`plan_zero_stage`, as ``zero_stage="auto"`` plans inside a run; for each layout the first checkpointing mode
(none, selective, full) with an option that fits a 10% margin is reported, with the chosen ZeRO stage and the
per-GPU total. The layouts and their sources:

* Llama 3 405B, 16,384 H100s, TP8 x PP16 x DP128 at 8,192 tokens (The Llama 3 Herd of Models, 2024, Table 4);
* the same with CP16 at 131,072 tokens (TP8 x CP16 x PP16 x DP8, same table);
* torchtitan's 405B on 512 H100s, FSDP8 x TP8 x PP8 at 8,192 tokens (the TorchTitan paper, ICLR 2025, its 3D run);
* Llama 3 8B with FSDP on 8 H100s at 8,192 tokens (torchtitan's ``llama3_8b.toml``: micro-batch 1).

Tensor parallelism runs with sequence parallelism, as in all three runs; each rank's activations are read from the
model's dataflow under its tensor-parallel plan (:mod:`lightning_llm.modeling.tp_shares`). Pipeline stages are planned
as 1F1B keeps them: the first stage holds ``pp`` micro-batches in flight of its
``1/pp`` of the blocks, the activations of one micro-batch through the whole model.

    python benchmarks/published_layouts.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.planning.device_memory import device_memory_bytes
from lightning_llm.planning.zero import GiB, MemoryPlanError, ZeroDecision, plan_zero_stage
from lightning_llm.strategies.zero_auto import model_footprint


@dataclass(frozen=True)
class Layout:
    name: str
    preset: str
    gpus: int
    seq_len: int
    tp: int = 1
    pp: int = 1
    cp: int = 1


LAYOUTS = [
    Layout("Llama 3 405B, 16,384 H100s, 8K", "405B", 16384, 8192, tp=8, pp=16),
    Layout("Llama 3 405B, 16,384 H100s, 128K", "405B", 16384, 131072, tp=8, pp=16, cp=16),
    Layout("torchtitan 405B, 512 H100s, 8K", "405B", 512, 8192, tp=8, pp=8),
    Layout("Llama 3 8B, 8 H100s, 8K", "8B", 8, 8192),
]


def plan(layout: Layout, device: str = "H100") -> tuple[str, ZeroDecision]:
    """The least checkpointing that fits and its decision; raises :class:`MemoryPlanError` when even full does not."""
    with torch.device("meta"):
        module = CausalLM(LlamaConfig.from_name(layout.preset, max_seq_len=layout.seq_len))
        module.configure_model()
    # Context parallelism splits the sequence: the footprint is measured whole and divided by cp in the plan.
    footprint = model_footprint(
        module,
        micro_batch_size=1,
        seq_len=layout.seq_len,
        precision="bf16-mixed",
        tp=layout.tp,
        sequence_parallel=layout.tp > 1,
    )
    error = None
    for mode in ("none", "selective", "full"):
        try:
            decision = plan_zero_stage(
                footprint,
                device_memory=device_memory_bytes(device),
                world_size=layout.gpus,
                tp=layout.tp,
                pp=layout.pp,
                cp=layout.cp,
                precision="bf16-mixed",
                activation_checkpointing=mode,
                allow_offload=False,
            )
            return mode, decision
        except MemoryPlanError as err:
            error = err
    raise error


def main() -> None:
    print("| layout | tp x cp x pp x dp | checkpointing needed | ZeRO | planned GiB per GPU (of 79.6) |")
    print("|---|---|---|---|---|")
    for layout in LAYOUTS:
        dp = layout.gpus // (layout.tp * layout.pp * layout.cp)
        mode, decision = plan(layout)
        row = next(r for r in decision.rows if (r.zero_stage, r.offload) == (decision.stage, decision.offload))
        shape = f"{layout.tp} x {layout.cp} x {layout.pp} x {dp}"
        print(f"| {layout.name} | {shape} | {mode} | {decision.stage} | {row.total / GiB:.1f} |")


if __name__ == "__main__":
    main()
