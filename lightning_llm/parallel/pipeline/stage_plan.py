"""How the model is cut into pipeline stages: the options (:class:`PipelineSpec`) and each stage's blocks and rank.

The split is the user's (``pipeline_split``) or balanced by modelled training FLOPs (:mod:`.costs`); stages go to
ranks as the schedule lays them out (:func:`.split.stage_to_rank`: looped for interleaved schedules, V-shaped for
ZBV). :mod:`.gates` then keeps this rank's stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_llm.modeling.blocks import BlockStack, block_names
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.pipeline.costs import stage_costs
from lightning_llm.parallel.pipeline.gates import StageChunk, outer_modules
from lightning_llm.parallel.pipeline.split import balanced_split, explicit_split, stage_to_rank, validate_schedule


@dataclass
class PipelineSpec:
    """How to cut the model into pipeline stages (see :mod:`lightning_llm.parallel.pipeline.gates`)."""

    schedule: str = "1F1B"
    num_microbatches: int | None = None
    virtual_stages: int | None = None
    split: list[list[str]] | None = None
    seq_len: int | None = None  # tokens per sample, for attention's share of the modelled stage FLOPs

    def stages_per_rank(self) -> int:
        return validate_schedule(self.schedule, self.virtual_stages)


def assign_stages(module: nn.Module, blocks_name: str, blocks: BlockStack, dims: ParallelDims, spec: PipelineSpec):
    """Every stage's block range and rank; returns (chunks of this rank, rank of each stage)."""
    num_stages = dims.pp * spec.stages_per_rank()
    if spec.split is not None:
        ranges = explicit_split(spec.split, blocks_name, len(blocks), num_stages, block_names(blocks_name, blocks))
    else:
        costs = stage_costs(module, blocks, *outer_modules(module, blocks_name), seq_len=spec.seq_len)
        ranges = balanced_split(costs.blocks, num_stages, head_cost=costs.last, first_cost=costs.first)
    ranks = stage_to_rank(num_stages, dims.pp, spec.schedule)
    pp_rank = dims.mesh["pp"].get_local_rank()
    chunks = [
        StageChunk(index=s, blocks=ranges[s], is_first=s == 0, is_last=s == num_stages - 1)
        for s in range(num_stages)
        if ranks[s] == pp_rank
    ]
    return chunks, ranks
