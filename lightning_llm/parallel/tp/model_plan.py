"""The whole model's tensor-parallel plan, resolved, validated and checked before any layer is split.

The plan is planned on the whole model (not one pipeline stage's part), so a refusal does not depend on the rank:
the user's entries, the module's ``tensor_parallel_plan()`` hook, the Hugging Face ``_tp_plan`` and inference
(:mod:`.plan`), then the layouts the traced forward shows (:mod:`.traced_layouts`: fused layers of unknown layout,
and column splits whose output the model cuts into parts), per-head lists, head counts and
coverage (:mod:`.coverage`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from torch import nn

from lightning_llm.modeling.blocks import BlockStack, distinct_blocks, find_blocks
from lightning_llm.modeling.output_cuts import Part
from lightning_llm.modeling.tp_shares import TensorParallelShares
from lightning_llm.parallel.tp.apply import (
    check_head_counts,
    class_representatives,
    head_split_parts,
    local_styles,
    part_entries,
    resolve_plan,
    validate_plan,
    with_per_head_lists,
)
from lightning_llm.parallel.tp.attention_variants import check_attention_variants, model_config, shares_kv
from lightning_llm.parallel.tp.coverage import check_coverage, sharded_region_modules, wildcard_index
from lightning_llm.parallel.tp.style_kinds import closes, dataflow_role, matches, opens
from lightning_llm.parallel.tp.traced_layouts import (
    head_counts,
    per_part_style,
    trace_fused_layouts,
    with_traced_layouts,
)

log = logging.getLogger(__name__)


def plan_tensor_parallel(
    module: nn.Module,
    *,
    tp: int,
    blocks_name: str,
    blocks: nn.ModuleList,
    user_plan: dict[str, str] | None,
    replicate: list[str] | tuple[str, ...] = (),
    expert_parallel: list[str] | tuple[str, ...] = (),
    output_cuts: Mapping[str, tuple[Part, ...]] | None = None,
    call_order: Sequence[str] = (),
) -> tuple[dict[str, str], str]:
    """Resolve, validate and check the coverage of the TP plan before anything is changed, so bad input fails early.

    ``expert_parallel`` names the experts modules expert parallelism splits: TP leaves them to it (whole experts
    per EP rank, the same on every tp rank, which all hold the same tokens there). ``output_cuts``: the linears
    whose outputs the model's traced forward cut into parts (``TracedBlocks.cuts``); without it one fake forward
    reads them. ``call_order``: every module the traced forward called, in order (``TracedBlocks.order``): a module
    with whole parameters called outside the split region (a pre-norm beside the layers that open it) is left out of
    it.

    Example::

        plan, source = plan_tensor_parallel(model, tp=2, blocks_name="model.layers", blocks=layers, user_plan=None)
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
    plan = with_cut_outputs(module, blocks_name, blocks, plan, user_plan, tp, output_cuts)
    plan = with_per_head_lists(plan, blocks_name, blocks)
    validate_plan(module, plan, tp)
    check_head_counts(module, head_split_parts(plan, blocks_name, blocks), tp, shared_kv=shares_kv(plan))
    check_coverage(blocks_name, blocks, plan, unknown, tp)
    return with_region_parameters(plan, blocks_name, blocks, call_order), source


def with_cut_outputs(
    module: nn.Module,
    blocks_name: str,
    blocks: BlockStack,
    plan: dict[str, str],
    user_plan: dict[str, str],
    tp: int,
    output_cuts: Mapping[str, tuple[Part, ...]] | None = None,
) -> dict[str, str]:
    """``plan`` with each column-split linear whose output the forward cuts into parts (``chunk``/``split`` along the
    last dimension: ModernBERT's ``Wi``, a ``[gate | up]`` projection under any name) split per part
    (``fused_colwise``), so each rank gets its share of every part. The cuts are ``output_cuts`` (what the
    strategy's traced forward saw, :mod:`~lightning_llm.modeling.output_cuts`), or, without them, read off one fake
    forward (:func:`~lightning_llm.parallel.tp.traced_layouts.trace_fused_layouts`). A plain ``colwise`` split would
    hand one rank the whole first part and the other the second, which the first forward would then refuse.
    Entries the user gave are kept as given.

    Example::

        with_cut_outputs(model, "model.layers", layers, {"model.layers.*.mlp.Wi": "colwise"}, {}, tp=2)
        # {"model.layers.*.mlp.Wi": "fused_colwise:64,64"}
    """
    keys = {}  # linear -> the plan entry that splits it column-wise
    for block_name, block in distinct_blocks(blocks_name, blocks):
        for sub, layer in block.named_modules():
            name = f"{block_name}.{sub}"
            key = next((k for k in plan if matches(name, k)), None)
            if isinstance(layer, nn.Linear) and key is not None and plan[key] == "colwise" and key not in user_plan:
                keys[name] = key
    if output_cuts is None:
        found = trace_fused_layouts(module, blocks_name, sorted(keys), tp) if keys else {}
    else:
        found = {name: style for name in keys if (style := per_part_style(output_cuts.get(name, ()), tp))}
    styles: dict[str, set[str]] = {}
    for name, key in keys.items():
        styles.setdefault(key, set()).add(found.get(name, "colwise"))
    heads = head_counts(module)
    dims = _head_dims(module, heads)
    agreed = {key: next(iter(s)) for key, s in styles.items() if len(s) == 1}  # every block of the entry alike
    cut = {key: style for key, style in agreed.items() if _cut_into_parts(style, heads, dims)}
    for key, style in cut.items():
        log.info("tensor parallel: %s is split as %r: the model cuts its output into parts", key, style)
    return {**plan, **cut}


def _cut_into_parts(style: str, heads: set[int], head_dims: set[int]) -> bool:
    """Whether ``style`` (a traced layout) is a cut into unlike parts: not one part per head (as many equal parts
    as a head count, each a head's width), which a column split giving each rank whole heads already serves
    (``split(head_dim, -1)`` of its shard)."""
    if not style.startswith("fused_colwise:"):
        return False
    sizes = [int(size.removeprefix("*")) for size in style.partition(":")[2].split(",")]
    per_head = len(set(sizes)) == 1 and len(sizes) in heads and (not head_dims or sizes[0] in head_dims)
    return not per_head


def _head_dims(module: nn.Module, heads: set[int]) -> set[int]:
    """The head widths the model's config states or implies (``head_dim``, ``hidden_size / heads``); empty when the
    config says neither."""
    config = model_config(module)
    hidden, head_dim = getattr(config, "hidden_size", None), getattr(config, "head_dim", None)
    dims = {head_dim} if isinstance(head_dim, int) else set()
    return dims | ({hidden // n for n in heads if hidden % n == 0} if isinstance(hidden, int) else set())


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


def planned_shares(
    module: nn.Module,
    *,
    tp: int,
    sequence_parallel: bool,
    user_plan: dict[str, str] | None = None,
    replicate: list[str] | tuple[str, ...] = (),
) -> TensorParallelShares:
    """What one of ``tp`` ranks holds of each activation, from the model's tensor-parallel plan: its column splits,
    row splits and gathered head (:mod:`lightning_llm.modeling.tp_shares`). Raises the plan's refusal (ValueError).

    Example::

        shares = planned_shares(model, tp=2, sequence_parallel=True)
    """
    found = find_blocks(module)
    plan, _ = plan_tensor_parallel(
        module, tp=tp, blocks_name=found.name, blocks=found.blocks, user_plan=user_plan, replicate=replicate
    )
    roles = {
        part: role
        for name, part in module.named_modules()
        for pattern, style in plan.items()
        if name and matches(name, pattern) and (role := dataflow_role(style)) is not None
    }
    return TensorParallelShares(tp, sequence_parallel, roles)


def with_region_parameters(
    plan: dict[str, str], blocks_name: str, blocks, call_order: Sequence[str] = ()
) -> dict[str, str]:
    """``plan`` plus ``replicate_grad_sum`` for every whole-parameter module inside a head-sharded region.

    Found per distinct block class (hybrid stacks mix them); entries the plan already has win; the first
    forward verifies the additions (see :mod:`.coverage`). Where ``call_order`` (the traced forward's modules, in
    order) shows a module called before any layer opening a split, or after one closing it with none opening
    another in between, it runs on whole activations and is not added (PaLM's pre-norm beside its fused projection).
    """
    plan = dict(plan)
    representatives = class_representatives(blocks_name, blocks)
    for name, block, members in representatives:
        local = local_styles(name, block, plan)
        order = {n[len(name) + 1 :]: i for i, n in enumerate(call_order) if n.startswith(name + ".")}
        for part in sharded_region_modules(block, local):
            if _called_on_whole_activations(part, local, order):
                continue
            plan.update(part_entries(blocks_name, len(representatives), members, part, "replicate_grad_sum"))
    return plan


def _called_on_whole_activations(part: str, styles: dict[str, str], order: dict[str, int]) -> bool:
    """Whether the last split boundary called before ``part`` (in the traced ``order``) closed a split, or none came."""
    if part not in order:
        return False
    boundaries = sorted((order[n], opens(s)) for n, s in styles.items() if n in order and (opens(s) or closes(s)))
    before = [is_open for index, is_open in boundaries if index < order[part]]
    return not (before and before[-1])
