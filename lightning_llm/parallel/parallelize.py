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

from dataclasses import dataclass, field

from torch import nn

from lightning_llm.modeling.blocks import (
    BlockSet,
    BlockStack,
    block_modules,
    block_names,
    distinct_blocks,
    entry_modules,
    find_blocks,
    loose_blocks,
)
from lightning_llm.modeling.tied import modules_shared_by_blocks, tied_parameter_names
from lightning_llm.parallel.cp import apply_context_parallel, check_context_parallel
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
from lightning_llm.parallel.pipeline.costs import stage_costs
from lightning_llm.parallel.pipeline.gates import StageChunk, outer_modules, prune_to_stages
from lightning_llm.parallel.pipeline.split import balanced_split, explicit_split, stage_to_rank, validate_schedule
from lightning_llm.parallel.tp.apply import (
    apply_tensor_parallel,
    check_head_counts,
    head_split_parts,
    resolve_plan,
    validate_plan,
    with_per_head_lists,
    with_region_parameters,
)
from lightning_llm.parallel.tp.attention_variants import check_attention_variants, model_config, shares_kv
from lightning_llm.parallel.tp.coverage import check_coverage, wildcard_index
from lightning_llm.parallel.tp.float8 import fp8_tp_exclusions
from lightning_llm.parallel.tp.traced_layouts import with_traced_layouts


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


def data_parallel_roots(module: nn.Module, blocks_name: str, blocks: BlockStack | None = None) -> list[nn.Module]:
    """The modules to make FSDP/replicate roots: the top-level child holding the blocks, plus any other child with parameters.

    The LightningModule itself cannot be the root: Lightning calls ``training_step``, not
    ``forward``, so FSDP2's root forward hook (which gathers embeddings and head) would never run.
    Blocks without a container (:class:`BlockSet`): the top-level children with parameters that are not blocks.
    """
    if loose_blocks(blocks):
        units = {id(b) for b in blocks}
        return [c for _, c in module.named_children() if id(c) not in units and any(True for _ in c.parameters())]
    top = blocks_name.split(".")[0]
    roots = [module.get_submodule(top)] if top != blocks_name else []
    for name, child in module.named_children():
        if name != top and any(True for _ in child.parameters()):
            roots.append(child)
    if not roots:  # the blocks are a direct child of the LightningModule
        roots = [module]
    return roots


def shared_between_blocks(blocks_name: str, blocks, dims: ParallelDims) -> list[nn.Module]:
    """The modules several blocks call (sharded once, as units of their own); refused where a layout splits blocks.

    Tensor parallelism splits a shared module once (its heads too: :func:`.tp.apply.apply_tensor_parallel`);
    pipeline parallelism puts blocks on different ranks, where a module called from several blocks would be needed
    on two stages.
    """
    shared = modules_shared_by_blocks(block_modules(blocks), block_names(blocks_name, blocks))
    if shared and dims.pp > 1:
        module, places = shared[0]
        raise ValueError(
            f"{places[0]} ({type(module).__name__}) is one module called from {len(places)} blocks ({places}); "
            f"pipeline_parallel_size={dims.pp} puts blocks on different ranks, and the module would be needed on "
            "two stages. Train this model with tensor or data parallelism (ZeRO 0-3), which split or shard a "
            "shared module once."
        )
    if shared and (dims.dp * dims.cp > 1) and (loose_blocks(blocks) or "." not in blocks_name):
        raise ValueError(
            f"{shared[0][1][0]} is one module called from several blocks, and the blocks {blocks_name or 'found'} "
            "are direct children of the LightningModule: data parallelism needs one module holding the blocks "
            "(the model: embedding, blocks, head) to own the shared module's unit. Hold the model in one attribute "
            "of the LightningModule (self.model = ...)."
        )
    return [module for module, _ in shared]


def check_block_set(blocks: BlockSet, dims: ParallelDims, fp8: str | None) -> None:
    """Refuse what needs the blocks in one container (cut, split or hooked by position) before anything changes."""
    asked = [
        f"{what}={size}"
        for what, size in (
            ("tensor_parallel_size", dims.tp),
            ("pipeline_parallel_size", dims.pp),
            ("context_parallel_size", dims.cp),
        )
        if size > 1
    ] + ([f"fp8={fp8!r}"] if fp8 is not None else [])
    if asked:
        raise ValueError(
            f"{', '.join(asked)} needs the model's transformer blocks in one nn.ModuleList, nn.Sequential or nn.ModuleDict, but "
            f"the blocks here share no container ({blocks.names[:4]}). Hold the blocks in an nn.ModuleList and "
            "pass blocks='dotted.name' if the search misses it, or parallelize in configure_model by hand on "
            "self.device_mesh['tensor_parallel'] (the strategy then keeps that layout)."
        )


def block_entries(
    blocks_name: str, blocks: BlockStack, block_calls: dict[str, list[str]] | None, root: nn.Module
) -> dict[int, list[nn.Module]]:
    """Block (by id) -> the modules its computation is entered through (:func:`entry_modules`); ``block_calls``: what a
    traced forward called inside the blocks whose own forward it did not call (names in ``root``)."""
    calls = block_calls or {}
    return {
        id(block): entry_modules(block, [root.get_submodule(n) for n in calls[name]] if name in calls else None)
        for name, block in zip(block_names(blocks_name, blocks), block_modules(blocks))
    }


def refuse_pipeline_without_block_forward(
    blocks_name: str, blocks: BlockStack, entries: dict[int, list[nn.Module]]
) -> None:
    """Pipeline stages stand in for other stages' blocks when the model calls them; a block the model does not call
    (its slots called one by one, or its forward bypassed) cannot be stood in for."""
    for name, block in zip(block_names(blocks_name, blocks), block_modules(blocks)):
        if entries[id(block)] != [block]:
            raise ValueError(
                f"pipeline_parallel_size > 1 needs each block to be one module the model calls, but {name} "
                f"({type(block).__name__}) is entered through {len(entries[id(block)])} modules of its own (the model's "
                "forward calls its parts one by one, or calls another method than its forward), so a stage cannot "
                "stand in for the blocks of other stages. Use tensor parallelism or ZeRO (zero_stage=3) for this model."
            )


def refuse_uncalled_split_parts(plan: dict[str, str], blocks_name: str, blocks: BlockStack, called: set[str]) -> None:
    """Refuse splitting the heads of a part the model's forward does not call as a module (``called``: the traced
    forward's calls): it runs another of its methods (yet-another-retnet's ``forward_parallel``), where the
    first-forward checks that catch a wrong split cannot watch it."""
    for name, part in head_split_parts(plan, blocks_name, blocks):
        if name not in called:
            raise ValueError(
                f"Tensor parallelism would split the heads of {name} ({type(part).__name__}), but the model's forward "
                "does not call it as a module (it runs another of its methods), so the split cannot be checked "
                f"against the whole part in the first forward. Keep it whole: tensor_parallel_replicate="
                f"['{wildcard_index(name)}'], or use ZeRO or pipeline parallelism for this model."
            )


def refuse_ties_across_units(module: nn.Module, blocks: BlockSet) -> None:
    """Refuse a tensor held by two of the FSDP units (blocks and roots) of a model without a block container:
    each unit would shard it on its own. A container's ties (embedding and head) sit in one root instead."""
    roots = {id(r) for r in data_parallel_roots(module, "", blocks)}
    units = list(zip(blocks.names, blocks)) + [(n, c) for n, c in module.named_children() if id(c) in roots]
    inside_block = tuple(f"{name}." for name in blocks.names)  # a root holds what its blocks do not
    owners: dict[int, dict[str, str]] = {}
    for name, unit in units:
        for param_name, param in unit.named_parameters(remove_duplicate=False):
            full = f"{name}.{param_name}"
            if name not in blocks.names and full.startswith(inside_block):
                continue
            owners.setdefault(id(param), {}).setdefault(name, full)
    shared = [sorted(held.values()) for held in owners.values() if len(held) > 1]
    if shared:
        raise ValueError(
            f"Parameters {shared[0]} are one tensor held by two of the units {[n for n, _ in units][:6]}, which "
            "data parallelism shards separately. Pass blocks= listing units that keep each tied pair inside one "
            "unit (e.g. their common parent), or untie the weights."
        )


def plan_tensor_parallel(
    module: nn.Module,
    *,
    tp: int,
    blocks_name: str,
    blocks: nn.ModuleList,
    user_plan: dict[str, str] | None,
    replicate: list[str] | tuple[str, ...] = (),
    expert_parallel: list[str] | tuple[str, ...] = (),
) -> tuple[dict[str, str], str]:
    """Resolve, validate and check the coverage of the TP plan before anything is changed, so bad input fails early.

    ``expert_parallel`` names the experts modules expert parallelism splits: TP leaves them to it (whole experts
    per EP rank, the same on every tp rank, which all hold the same tokens there).
    """
    user_plan = {**(user_plan or {}), **dict.fromkeys(expert_parallel, "expert_parallel")}
    config = model_config(module)
    for name, block in distinct_blocks(blocks_name, blocks):  # a variant that cannot be split is refused first
        check_attention_variants(block, tp, config, where=name)
    hook = getattr(module, "tensor_parallel_plan", None)
    module_plan = hook() if callable(hook) else None
    plan, source, unknown, contested = resolve_plan(
        module,
        blocks_name=blocks_name,
        blocks=blocks,
        user_plan=user_plan,
        module_plan=module_plan,
        replicate=replicate,
    )
    plan, unknown = with_traced_layouts(module, blocks_name, plan, unknown, tp, contested)
    plan = with_per_head_lists(plan, blocks_name, blocks)
    validate_plan(module, plan, tp)
    check_head_counts(module, head_split_parts(plan, blocks_name, blocks), tp, shared_kv=shares_kv(plan))
    check_coverage(blocks_name, blocks, plan, unknown, tp)
    return with_region_parameters(plan, blocks_name, blocks), source


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


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    *,
    zero_stage: int,
    precision: str = "32-true",
    sequence_parallel: bool = False,
    tensor_parallel_plan: dict[str, str] | None = None,
    tensor_parallel_replicate: list[str] | None = None,
    blocks: str | list[str] | None = None,
    block_calls: dict[str, list[str]] | None = None,
    called: set[str] | None = None,
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

    ``activation_checkpointing`` is a callable ``(blocks, entries) -> None`` applied between TP and FSDP,
    or ``None``; ``entries`` maps ``id(block)`` to the modules the block is entered through (the block itself,
    or its slots when the stack runs them from its own forward), which is what it checkpoints. With ``pipeline`` (and ``dims.pp > 1``) this rank keeps only its stages; the
    pipeline runtime is built from the report afterwards. ``fp8`` ("tensorwise"/"rowwise") trains
    the blocks' Linear layers in fp8 (:mod:`lightning_llm.parallel.float8`). ``expert_parallel_size > 1``
    splits every experts module by expert over that many data-parallel ranks (:mod:`lightning_llm.parallel.ep`). With ``dims.cp > 1`` every sequence
    is split over the ``cp`` axis (:mod:`lightning_llm.parallel.cp`), and FSDP shards over ``dp × cp``.

    Example::

        dims = ParallelDims(world_size=4, tp=2)
        dims.build_mesh("cpu")
        parallelize(lightning_module, dims, zero_stage=3)
    """
    blocks_name, block_list = find_blocks(module, blocks)
    report = ParallelizeReport(blocks_name=blocks_name, num_blocks=len(block_list), zero_stage=zero_stage)
    entries = block_entries(blocks_name, block_list, block_calls, module)
    if pipeline is not None and dims.pp > 1:
        refuse_pipeline_without_block_forward(blocks_name, block_list, entries)
    if loose_blocks(block_list):
        check_block_set(block_list, dims, fp8)
        if dims.dp * dims.cp > 1:
            refuse_ties_across_units(module, block_list)
        report.block_names = list(block_list.names)
    if dims.cp > 1:  # refused before anything is changed
        check_context_parallel(module, blocks_name=blocks_name, blocks=list(block_list))
    shared = shared_between_blocks(blocks_name, block_list, dims)
    ep_split = (
        check_expert_parallel_model(module, expert_parallel_size, expert_parallel_plan)
        if expert_parallel_size > 1
        else []
    )
    if dims.tp > 1:  # planned on the whole model, so errors do not depend on the pipeline rank
        report.tp_plan, report.tp_plan_source = plan_tensor_parallel(
            module,
            tp=dims.tp,
            blocks_name=blocks_name,
            blocks=block_list,
            user_plan=tensor_parallel_plan,
            replicate=tensor_parallel_replicate or (),
            expert_parallel=ep_split,
        )
        if called is not None:
            refuse_uncalled_split_parts(report.tp_plan, blocks_name, block_list, called)
    if dims.cp > 1:  # hooks on the model's input/output and each block's attention, before TP copies any config
        report.context_parallel = apply_context_parallel(
            module,
            blocks_name=blocks_name,
            blocks=list(block_list),
            cp_mesh=dims.mesh["cp"],
            method=context_parallel_method,
            tp=dims.tp,
        )
    owned_blocks, roots = list(block_list), None
    if pipeline is not None and dims.pp > 1:
        report.tied = tied_parameter_names(module)
        report.chunks, report.stage_ranks = assign_stages(module, blocks_name, block_list, dims, pipeline)
        report.outer = prune_to_stages(module, blocks_name, block_list, report.chunks)
        owned_blocks = [block_list[i] for c in report.chunks for i in c.blocks]
        roots = [module.get_submodule(n) for n in report.outer["before"] + report.outer["after"]]
    expert_meshes, experts = None, []
    if expert_parallel_size > 1:
        expert_meshes = build_expert_meshes(dims, expert_parallel_size)
        experts = apply_expert_parallel(module, ep_split, meshes=expert_meshes)
        report.expert_parallel_modules = len(experts)
    if fp8 is not None:
        shards = zero_stage in (1, 2, 3) and dims.dp_shard > 1
        # Under TP only the column/row-split layers train in fp8 (see parallel/tp/float8.py).
        split_only = fp8_tp_exclusions(module, report.tp_plan, blocks_name) if dims.tp > 1 else []
        report.fp8_layers = apply_fp8(
            module,
            blocks_name=blocks_name,
            recipe=fp8,
            exclude=[*(fp8_exclude or ()), *split_only],
            fsdp_float8_all_gather=shards and fp8 == "tensorwise",
        )
    if dims.tp > 1:
        report.tp_coverage = apply_tensor_parallel(
            module,
            report.tp_plan,
            tp_mesh=dims.mesh["tp"],
            blocks=owned_blocks,
            sequence_parallel=sequence_parallel,
            blocks_name=blocks_name,
            entries=entries,
            check_parts=dims.cp == 1 and expert_parallel_size == 1 and _first_pipeline_rank(dims),
        )
    if activation_checkpointing is not None:
        activation_checkpointing(owned_blocks, entries)
    if compile_blocks:
        for block in owned_blocks:
            for unit in entries[id(block)]:
                unit.compile()
    if dims.dp * dims.cp > 1 or cpu_offload:  # one replica: the precision plugin autocasts, FSDP would only copy
        dp_mesh = dims.data_parallel_mesh()
        if experts:
            apply_expert_data_parallel(
                experts,
                meshes=expert_meshes,
                zero_stage=zero_stage,
                mp_policy=mixed_precision_policy(precision),
                cpu_offload=cpu_offload,
            )
        dp_roots = roots if roots is not None else data_parallel_roots(module, blocks_name, block_list)
        apply_data_parallel(
            dp_roots,
            owned_blocks,
            dp_mesh=dp_mesh,
            zero_stage=zero_stage,
            mp_policy=mixed_precision_policy(precision),
            cpu_offload=cpu_offload,
            shared=shared,
            entries=entries,
        )
        if dims.tp > 1 and roots is None:  # the TP head's gathered logits are a view (see parallel/output_views.py)
            report.output_guard = OutputViewGuard(dp_roots)
    return report


def _first_pipeline_rank(dims: ParallelDims) -> bool:
    """Whether this rank's blocks see real inputs in their first forward: a later pipeline stage first runs on the
    empty tensors torch's schedule learns its output shapes from (what the first-forward check would compare)."""
    return dims.pp == 1 or dims.mesh["pp"].get_local_rank() == 0
