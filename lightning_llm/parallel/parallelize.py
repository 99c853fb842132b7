"""The parallelization recipe: pipeline split, tensor parallel, activation checkpointing, compile, data parallel.

The order matters and is the one torchtitan uses: the pipeline split first (each rank keeps its
stages), expert parallelism (whole experts per EP rank, DTensors on the ``ep`` axis), the fp8 swap of Linear layers
(torchao's ``Float8Linear`` must exist before FSDP2 wraps the weights, so that FSDP2 can all-gather them in fp8, and
before TP, which gives it torchao's float8 styles), then TP (it replaces Linear weights by
DTensors on the ``tp`` axis), activation checkpointing next (torch's composable checkpoint around each block, which TP
hooks sit inside), per-block ``torch.compile``, and FSDP2/replicate last (its per-block units
gather the TP-sharded DTensors along the ``dp`` axes; the experts get their own units over the ``edp`` axis first). Context parallelism hooks in right after the plans are checked
and before anything is cut (its attention switch must precede the per-module config copies TP makes for head counts);
FSDP then shards over ``dp × cp``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_llm.modeling.blocks import BlocksOverride, FoundBlocks, found_blocks, loose_blocks
from lightning_llm.modeling.structure import TracedBlocks
from lightning_llm.modeling.tied import tied_parameter_names
from lightning_llm.parallel.block_units import (
    block_entries,
    check_block_set,
    data_parallel_roots,
    refuse_pipeline_without_block_forward,
    refuse_ties_across_units,
    shared_between_blocks,
)
from lightning_llm.parallel.cp import apply_context_parallel, check_context_parallel, refuse_blocks_not_called
from lightning_llm.parallel.data_parallel import apply_data_parallel, mixed_precision_policy
from lightning_llm.parallel.ep.apply import (
    apply_expert_data_parallel,
    apply_expert_parallel,
    check_expert_parallel_model,
)
from lightning_llm.parallel.ep.mesh import build_expert_meshes
from lightning_llm.parallel.float8 import apply_fp8
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.output_views import OutputViewGuard
from lightning_llm.parallel.pipeline.gates import prune_to_stages
from lightning_llm.parallel.pipeline.stage_plan import PipelineSpec, assign_stages
from lightning_llm.parallel.tp.apply import apply_tensor_parallel
from lightning_llm.parallel.tp.float8 import fp8_tp_exclusions
from lightning_llm.parallel.tp.model_plan import plan_tensor_parallel, refuse_uncalled_split_parts

__all__ = ["ParallelizeReport", "PipelineSpec", "parallelize", "plan_tensor_parallel", "refuse_ties_across_units"]


@dataclass
class ParallelizeReport:
    """What :func:`parallelize` did, for logging and for the W&B config."""

    blocks_name: str
    num_blocks: int
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_plan_source: str = ""
    tp_coverage: list[str] = field(default_factory=list)
    zero_stage: int = 0
    chunks: list = field(default_factory=list)
    stage_ranks: list[int] = field(default_factory=list)
    outer: dict = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    fp8_layers: list[str] = field(default_factory=list)
    expert_parallel_modules: int = 0
    context_parallel: str = ""
    block_names: list[str] = field(default_factory=list)  # blocks without a container (BlockSet): their names
    output_guard: OutputViewGuard | None = None  # checks the view logits TP returns after each backward


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    *,
    zero_stage: int,
    precision: str = "32-true",
    sequence_parallel: bool = False,
    tensor_parallel_plan: dict[str, str] | None = None,
    tensor_parallel_replicate: list[str] | None = None,
    blocks: FoundBlocks | BlocksOverride = None,
    traced: TracedBlocks | None = None,
    cpu_offload: bool = False,
    compile_blocks: bool = False,
    activation_checkpointing=None,
    pipeline: PipelineSpec | None = None,
    fp8: str | None = None,
    fp8_exclude: list[str] | None = None,
    expert_parallel_size: int = 1,
    expert_parallel_plan: dict[str, str] | None = None,
    context_parallel_method: str = "ring",
) -> ParallelizeReport:
    """Apply PP splitting, TP/SP, activation checkpointing, compile and ZeRO data parallelism in place.

    ``blocks``: the :class:`~lightning_llm.modeling.blocks.FoundBlocks` the strategy found, or what ``find_blocks``
    takes. ``traced``: the blocks as the traced forward ran them (:mod:`~lightning_llm.modeling.structure`), or
    ``None``. ``activation_checkpointing``: ``(blocks, entries) -> None``, applied between TP and FSDP to the
    modules each block is entered through. The other arguments are the strategy's options of the same names.

    Example::

        dims = ParallelDims(world_size=4, tp=2); dims.build_mesh("cpu")
        parallelize(lightning_module, dims, zero_stage=3)
    """
    found = found_blocks(module, blocks)
    report = ParallelizeReport(blocks_name=found.name, num_blocks=len(found.blocks), zero_stage=zero_stage)
    pipelined = pipeline is not None and dims.pp > 1
    bypassed = traced.bypassed() if traced is not None else None
    units = Units(found, block_entries(found.name, found.blocks, bypassed, module), list(found.blocks))
    units.shared = check_layout(module, units, dims, report, pipelined=pipelined, fp8=fp8)
    if expert_parallel_size > 1:
        units.ep_split = check_expert_parallel_model(module, expert_parallel_size, expert_parallel_plan)
    plan_splits(
        module, units, dims, report, tensor_parallel_plan, tensor_parallel_replicate, traced, context_parallel_method
    )
    if pipelined:
        cut_pipeline(module, units, dims, pipeline, report, traced.before if traced is not None else ())
    if expert_parallel_size > 1:
        report.expert_parallel_modules = split_experts(module, units, dims, expert_parallel_size)
    if fp8 is not None:
        report.fp8_layers = swap_fp8(module, found.name, dims, report.tp_plan, fp8, fp8_exclude, zero_stage=zero_stage)
    if dims.tp > 1:
        check_parts = dims.cp == 1 and expert_parallel_size == 1 and _first_pipeline_rank(dims)
        order = traced.order if traced is not None else ()
        report.tp_coverage = split_layers(module, units, dims, report.tp_plan, sequence_parallel, check_parts, order)
    if activation_checkpointing is not None:
        activation_checkpointing(units.owned, units.entries)
    for unit in units.entered() if compile_blocks else ():
        unit.compile()
    if dims.dp * dims.cp > 1 or cpu_offload:  # one replica: the precision plugin autocasts, FSDP would only copy
        shard(module, units, dims, report, zero_stage=zero_stage, precision=precision, cpu_offload=cpu_offload)
    return report


@dataclass
class Units:
    """The blocks, the modules each is entered through, and what the steps before data parallelism leave for it."""

    found: FoundBlocks
    entries: dict[int, list[nn.Module]]  # id(block) -> the block, or its slots the stack's forward calls
    owned: list[nn.Module]  # this rank's blocks (all of them without pipeline parallelism)
    roots: list[nn.Module] | None = None  # with pipeline parallelism: the modules outside the blocks this rank keeps
    shared: list[nn.Module] = field(default_factory=list)  # modules several blocks call
    ep_split: list[str] = field(default_factory=list)  # with expert parallelism: the experts modules it splits
    experts: list[nn.Module] = field(default_factory=list)  # ... and those modules once split
    expert_meshes: Any = None

    def entered(self) -> list[nn.Module]:
        """The modules this rank's blocks are entered through (what compile wraps)."""
        return [unit for block in self.owned for unit in self.entries[id(block)]]


def shard(
    module: nn.Module,
    units: Units,
    dims: ParallelDims,
    report: ParallelizeReport,
    *,
    zero_stage: int,
    precision: str,
    cpu_offload: bool,
) -> None:
    """ZeRO data parallelism (FSDP2) over ``dp × cp``: the experts' units first, then each block and the roots."""
    dp_roots = (
        units.roots if units.roots is not None else data_parallel_roots(module, units.found.name, units.found.blocks)
    )
    policy = mixed_precision_policy(precision)
    if units.experts:
        apply_expert_data_parallel(
            units.experts, meshes=units.expert_meshes, zero_stage=zero_stage, mp_policy=policy, cpu_offload=cpu_offload
        )
    apply_data_parallel(
        dp_roots,
        units.owned,
        dp_mesh=dims.data_parallel_mesh(),
        zero_stage=zero_stage,
        mp_policy=policy,
        cpu_offload=cpu_offload,
        shared=units.shared,
        entries=units.entries,
    )
    if dims.tp > 1 and units.roots is None:  # the TP head's gathered logits are a view (see parallel/output_views.py)
        report.output_guard = OutputViewGuard(dp_roots)


def plan_splits(
    module: nn.Module,
    units: Units,
    dims: ParallelDims,
    report: ParallelizeReport,
    user_plan: dict[str, str] | None,
    replicate: list[str] | None,
    traced: TracedBlocks | None,
    context_parallel_method: str,
) -> None:
    """The tensor-parallel plan, planned on the whole model (its errors do not depend on the pipeline rank), and
    context parallelism's hooks on the model's input/output and each block's attention (before TP copies any
    config for its head counts)."""
    found = units.found
    if dims.tp > 1:
        report.tp_plan, report.tp_plan_source = plan_tensor_parallel(
            module,
            tp=dims.tp,
            blocks_name=found.name,
            blocks=found.blocks,
            user_plan=user_plan,
            replicate=replicate or (),
            expert_parallel=units.ep_split,
            output_cuts=traced.cuts if traced is not None else None,
            call_order=traced.order if traced is not None else (),
        )
        if traced is not None:
            refuse_uncalled_split_parts(report.tp_plan, found.name, found.blocks, traced.called)
    if dims.cp > 1:
        if traced is not None:
            refuse_blocks_not_called(found.name, found.blocks, traced.called)
        report.context_parallel = apply_context_parallel(
            module,
            blocks_name=found.name,
            blocks=found.blocks,
            cp_mesh=dims.mesh["cp"],
            method=context_parallel_method,
            tp=dims.tp,
            pipelined=dims.pp > 1,
            attends=traced.attends if traced is not None else None,
        )


def split_layers(
    module: nn.Module,
    units: Units,
    dims: ParallelDims,
    plan: dict[str, str],
    sequence_parallel: bool,
    check_parts: bool,
    call_order: Sequence[str] = (),
) -> list[str]:
    """Tensor parallelism on this rank's blocks (and the model's embedding and head); returns the coverage lines."""
    return apply_tensor_parallel(
        module,
        plan,
        tp_mesh=dims.mesh["tp"],
        blocks=units.owned,
        sequence_parallel=sequence_parallel,
        blocks_name=units.found.name,
        entries=units.entries,
        check_parts=check_parts,
        call_order=call_order,
    )


def split_experts(module: nn.Module, units: Units, dims: ParallelDims, size: int) -> int:
    """Expert parallelism: whole experts per rank of the ``ep`` axis; returns how many experts modules it split."""
    units.expert_meshes = build_expert_meshes(dims, size)
    units.experts = apply_expert_parallel(module, units.ep_split, meshes=units.expert_meshes)
    return len(units.experts)


def check_layout(
    module: nn.Module, units: Units, dims: ParallelDims, report: ParallelizeReport, *, pipelined: bool, fp8: str | None
) -> list[nn.Module]:
    """Refuse what this layout cannot do with these blocks, before anything is changed; returns the modules several
    blocks share (sharded once, as units of their own)."""
    found = units.found
    if pipelined:
        refuse_pipeline_without_block_forward(found.name, found.blocks, units.entries)
    if loose_blocks(found.blocks):
        check_block_set(found.blocks, dims, fp8)
        if dims.dp * dims.cp > 1:
            refuse_ties_across_units(module, found.blocks)
        report.block_names = list(found.blocks.names)
    if dims.cp > 1:
        check_context_parallel(module, blocks_name=found.name, blocks=list(found.blocks), pipelined=dims.pp > 1)
    return shared_between_blocks(found.name, found.blocks, dims)


def cut_pipeline(
    module: nn.Module,
    units: Units,
    dims: ParallelDims,
    pipeline: PipelineSpec,
    report: ParallelizeReport,
    called_before: Collection[str] = (),
) -> None:
    """Keep this rank's pipeline stages: its blocks, and the modules outside them it keeps (embedding, head).
    ``called_before``: the modules the traced forward ran before the blocks (they stay with the first stage)."""
    found = units.found
    report.tied = tied_parameter_names(module)
    report.chunks, report.stage_ranks = assign_stages(module, found.name, found.blocks, dims, pipeline)
    report.outer = prune_to_stages(module, found.name, found.blocks, report.chunks, called_before)
    units.owned = [found.blocks[i] for chunk in report.chunks for i in chunk.blocks]
    units.roots = [module.get_submodule(n) for n in report.outer["before"] + report.outer["after"]]


def swap_fp8(
    module: nn.Module,
    blocks_name: str,
    dims: ParallelDims,
    tp_plan: dict[str, str],
    recipe: str,
    exclude: list[str] | None,
    *,
    zero_stage: int,
) -> list[str]:
    """Swap the blocks' Linear layers for torchao's fp8 ones (before TP and FSDP wrap them); returns their names."""
    shards = zero_stage in (1, 2, 3) and dims.dp_shard > 1
    # Under TP only the column/row-split layers train in fp8 (see parallel/tp/float8.py).
    split_only = fp8_tp_exclusions(module, tp_plan, blocks_name) if dims.tp > 1 else []
    return apply_fp8(
        module,
        blocks_name=blocks_name,
        recipe=recipe,
        exclude=[*(exclude or ()), *split_only],
        fsdp_float8_all_gather=shards and recipe == "tensorwise",
    )


def _first_pipeline_rank(dims: ParallelDims) -> bool:
    """Whether this rank's blocks see real inputs in their first forward: a later pipeline stage first runs on the
    empty tensors torch's schedule learns its output shapes from (what the first-forward check would compare)."""
    return dims.pp == 1 or dims.mesh["pp"].get_local_rank() == 0
