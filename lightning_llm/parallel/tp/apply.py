"""Tensor (+ sequence) parallelism for any model: apply a resolved plan with ``parallelize_module``.

Plan resolution lives in :mod:`.plan` (and HF style translation in :mod:`.style_kinds`, the entries
sequence parallelism adds in :mod:`.sequence_parallel_plan`), style construction in :mod:`.styles`,
head counts in :mod:`.heads`, and the replicated parameters of the head-sharded region in
:mod:`.coverage`. With sequence parallelism
the activations between blocks stay sequence-sharded DTensors, so model code that reads
``x.shape`` keeps seeing global shapes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_llm.modeling.blocks import block_kind, block_modules, block_names, entry_modules, has_own_forward
from lightning_llm.modeling.tied import tied_parameter_names
from lightning_llm.parallel.tp.attention_heads import per_head_lists, shard_attention_heads, splits_heads
from lightning_llm.parallel.tp.attention_variants import model_config
from lightning_llm.parallel.tp.coverage import (
    coverage_lines,
    region_owners,
    verify_on_first_forward,
)
from lightning_llm.parallel.tp.first_forward_parity import check_first_forward, explain_first_forward, whole_copy
from lightning_llm.parallel.tp.first_forward_widths import localize_whole_widths, width_note
from lightning_llm.parallel.tp.fused import FUSED_PREFIX, fused_sizes, projection_dims, shared_parts
from lightning_llm.parallel.tp.heads import (
    block_head_counts,
    check_head_counts,
    divide_head_counts,
    localize_part_widths,
)
from lightning_llm.parallel.tp.plan import STYLES, infer_plan, resolve_plan, validate_plan
from lightning_llm.parallel.tp.sequence_boundaries import adapt_block_parts
from lightning_llm.parallel.tp.sequence_parallel_plan import (
    add_sequence_parallel_boundaries,
    add_sequence_parallel_norms,
)
from lightning_llm.parallel.tp.split_outputs import watch_first_forward
from lightning_llm.parallel.tp.style_kinds import HF_STYLES, hf_plan, matches, opens
from lightning_llm.parallel.tp.styles import parallel_style

__all__ = [
    "HF_STYLES",
    "STYLES",
    "apply_tensor_parallel",
    "check_head_counts",
    "class_representatives",
    "divide_head_counts",
    "hf_plan",
    "infer_plan",
    "part_entries",
    "resolve_plan",
    "validate_plan",
    "with_per_head_lists",
]

log = logging.getLogger(__name__)


def class_representatives(blocks_name: str, blocks) -> list[tuple[str, nn.Module, list[str]]]:
    """(name of the first block, the block, names of every block) per distinct kind of the owned blocks.

    Example::

        class_representatives("model.layers", layers)   # [("model.layers.0", layers[0], ["model.layers.0", ...])]
    """
    kinds: dict[tuple, list[tuple[str, nn.Module]]] = {}
    for name, block in zip(block_names(blocks_name, blocks), block_modules(blocks)):
        if not getattr(block, "is_pipeline_placeholder", False):
            kinds.setdefault(block_kind(block), []).append((name, block))
    return [(members[0][0], members[0][1], [n for n, _ in members]) for members in kinds.values()]


def local_styles(block_name: str, block: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The plan's styles for the modules of one block, by their names inside it."""
    return {
        name: style
        for name, _ in block.named_modules()
        for pattern, style in plan.items()
        if name and matches(f"{block_name}.{name}", pattern)
    }


def head_split_parts(plan: dict[str, str], blocks_name: str, blocks) -> list[tuple[str, nn.Module]]:
    """(name, module) of each block class's parts whose heads the plan splits (the smallest module holding a
    column split and the row split closing it; the block itself where no such pair exists)."""
    parts = []
    for name, block, _ in class_representatives(blocks_name, blocks):
        local = local_styles(name, block, plan)
        if not any(opens(s) for s in local.values()):
            continue
        owners = region_owners(local) or {""}
        parts += [(f"{name}.{o}" if o else name, block.get_submodule(o) if o else block) for o in sorted(owners)]
    return parts


def with_per_head_lists(plan: dict[str, str], blocks_name: str, blocks) -> dict[str, str]:
    """``plan`` plus ``per_head`` for each list of one module per head inside attention whose heads ``plan`` splits.

    Per distinct block class, like :func:`.model_plan.with_region_parameters`; entries the plan already has win.
    """
    plan = dict(plan)
    representatives = class_representatives(blocks_name, blocks)
    for name, block, members in representatives:
        local = local_styles(name, block, plan)
        for part in per_head_lists(block, lambda attention, local=local: splits_heads(attention, local)):
            if any(matches(f"{name}.{part}", p) for p in plan):
                continue
            plan.update(part_entries(blocks_name, len(representatives), members, part, "per_head"))
    return plan


def part_entries(blocks_name: str, kinds: int, members: list[str], part: str, style: str) -> dict[str, str]:
    """Plan entries giving ``part`` of the blocks ``members`` ``style``: one wildcard entry where the blocks are of one
    kind (``kinds``), else one per member.

    Example::

        part_entries("model.layers", 1, ["model.layers.0"], "self_attn.q_norm", "replicate_grad_sum")
        # {"model.layers.*.self_attn.q_norm": "replicate_grad_sum"}
    """
    if kinds == 1:
        return {f"{blocks_name}.*.{part}": style}
    return {f"{member}.{part}": style for member in members}


def apply_tensor_parallel(
    model: nn.Module,
    plan: dict[str, str],
    *,
    tp_mesh: DeviceMesh,
    blocks: list[nn.Module],
    sequence_parallel: bool,
    blocks_name: str = "",
    entries: dict[int, list[nn.Module]] | None = None,
    check_parts: bool = True,
    call_order: Sequence[str] = (),
) -> list[str]:
    """Shard ``model`` in place with ``parallelize_module`` following ``plan`` (already validated).

    ``entries``: block (by id) -> the modules it is entered through where the model does not call it as a whole
    (:func:`~lightning_llm.modeling.blocks.entry_modules`); the first-forward checks watch those. ``check_parts``:
    compare each split part's first forward with the part computed whole (off under context parallelism, where a
    part sees a shard of the sequence and its attention reaches the other shards through the ring). ``call_order``:
    the traced forward's modules in order, which tells a pre-norm from a norm inside a split part under SP.
    Returns the coverage report of this rank's blocks (see :func:`.coverage.coverage_lines`).
    """
    if sequence_parallel:
        plan = add_sequence_parallel_norms(
            model, add_sequence_parallel_boundaries(model, plan, blocks_name), blocks_name, call_order
        )
    tied = tied_parameter_names(model)
    explicit, styled = _torch_styles(model, plan, sequence_parallel)
    wholes = _whole_parts(model, plan, blocks) if check_parts else {}  # the split parts, copied before the split
    parallelize_module(model, tp_mesh, explicit)
    _retie(model, tied)
    if sequence_parallel:
        adapt_block_parts(blocks, tp_mesh, skip=styled)
    heads = _split_blocks_heads(model, plan, blocks, tp_mesh, entries or {})
    for label, (part, whole, siblings) in wholes.items():
        widths = None if siblings is None else partial(localize_whole_widths, label=label, siblings=siblings)
        check_first_forward(part, whole, label, before=widths)
    log.info(
        "Applied tensor parallel (tp=%d%s) to %d modules; divided %d head counts",
        tp_mesh.size(),
        ", sequence parallel" if sequence_parallel else "",
        len(explicit),
        heads,
    )
    return coverage_lines(blocks)


def _torch_styles(model: nn.Module, plan: dict[str, str], sequence_parallel: bool) -> tuple[dict, set[int]]:
    """The torch ``ParallelStyle`` of each module ``plan`` names (module name -> style), and the styled modules' ids."""
    # Pipeline placeholders stand where another rank's modules are; they have nothing to shard.
    modules = {n: m for n, m in model.named_modules() if n and not getattr(m, "is_pipeline_placeholder", False)}
    # Inside a module that gathers the whole sequence (an MoE block under SP), layers see whole sequences.
    gathered = [n for n in modules for p, s in plan.items() if s == "gather_sequence" and matches(n, p)]
    explicit, styled = {}, set()
    for pattern, style in plan.items():
        for name, module in modules.items():
            sp_here = sequence_parallel and not any(name.startswith(g + ".") for g in gathered)
            if matches(name, pattern) and (torch_style := parallel_style(style, sp_here, module)) is not None:
                explicit[name] = torch_style
                styled.add(id(module))
    return explicit, styled


def _split_blocks_heads(
    model: nn.Module, plan: dict[str, str], blocks: list[nn.Module], tp_mesh: DeviceMesh, entries: dict
) -> int:
    """Split each block's per-head state, divide its head counts and set up its first-forward checks.

    Returns how many head counts were divided.
    """
    names, config, tp = {id(m): n for n, m in model.named_modules()}, model_config(model), tp_mesh.size()
    heads = 0
    # A module several blocks call (Zamba's shared transformer) is styled once (named_modules lists it once);
    # its heads are split and its counts divided once, at its first block.
    split, divided, explained = set(), set(), set()
    for block in blocks:
        name = names[id(block)]
        local = local_styles(name, block, plan)
        shard_attention_heads(block, local, tp_mesh, config, split)  # per-head parameters, ALiBi: before the counts
        whole_counts = block_head_counts(block)
        if any(opens(s) for s in local.values()):  # a block whose heads all stay whole keeps its counts
            heads += divide_head_counts([block], tp, region_owners(local) or None, divided)
            heads += _localize_cut_widths(block, local, tp)
            _explain_parts(block, name, local, tp, explained)
        _watch_first_forward(block, name, local, (whole_counts, block_head_counts(block)), entries.get(id(block)))
    return heads


def _localize_cut_widths(block: nn.Module, local: dict[str, str], tp: int) -> int:
    """Give the module holding each fused layer of ``block`` this rank's widths of the parts its forward cuts the
    output into, where it keeps them in an attribute (see :func:`.heads.localize_part_widths`)."""
    changed = 0
    for rel, style in local.items():
        if rel and style.startswith(FUSED_PREFIX):
            sizes = fused_sizes(style, projection_dims(block.get_submodule(rel))[1])
            owner = block.get_submodule(rel.rpartition(".")[0]) if "." in rel else block
            changed += len(localize_part_widths(owner, sizes, shared_parts(style), tp))
    return changed


def _explain_parts(block: nn.Module, name: str, local: dict[str, str], tp: int, explained: set[int]) -> None:
    """Have each head-split part of ``block`` explain a failing first forward (once per part, see ``explained``)."""
    for owner in sorted(region_owners(local) or {""}):
        part = block.get_submodule(owner) if owner else block
        if id(part) not in explained:
            explained.add(id(part))
            explain_first_forward(part, partial(width_note, f"{name}.{owner}" if owner else name, tp=tp))


def _watch_first_forward(block: nn.Module, name: str, local: dict[str, str], counts: tuple, units) -> None:
    """Check on ``block``'s first forward its replicated parameters and the outputs of its column splits."""
    entered = _entered(block, units)
    verify_on_first_forward(block, local, label=name, last=entered[-1][1])
    for rel, unit in entered:
        styles = _relative(local, rel)
        label = f"{name}.{rel}" if rel else name
        watch_first_forward(unit, [n for n, s in styles.items() if s == "colwise"], label=label, heads=counts)


def _whole_parts(model: nn.Module, plan: dict[str, str], blocks: list[nn.Module]) -> dict[str, tuple]:
    """Label -> (part, its copy, the same part in the other blocks of its kind, or ``None`` for a whole block) for
    the split parts of the first block of each kind (see :mod:`.first_forward_parity`): the region owners, and
    PyTorch's ``nn.MultiheadAttention`` split whole."""
    names, parts, firsts = {id(m): n for n, m in model.named_modules()}, {}, {}
    for block in blocks:
        first = firsts.setdefault(block_kind(block), names[id(block)])
        local = local_styles(names[id(block)], block, plan)
        owners = {o for o in region_owners(local)} | {n for n, s in local.items() if s == "multihead_attention"}
        for owner in sorted(owners):
            part = block.get_submodule(owner) if owner else block
            label = f"{first}.{owner}" if owner else first
            if first == names[id(block)] and has_own_forward(part):
                parts[label] = (part, whole_copy(part), () if owner else None)
            elif owner and label in parts:
                parts[label] = (*parts[label][:2], (*parts[label][2], part))
    return parts


def _entered(block: nn.Module, units: list[nn.Module] | None) -> list[tuple[str, nn.Module]]:
    """(name inside ``block``, module) of the modules the block is entered through (the block itself by default)."""
    units = units or entry_modules(block)
    names = {id(m): n for n, m in block.named_modules()}
    return [(names[id(unit)], unit) for unit in units]


def _relative(styles: dict[str, str], rel: str) -> dict[str, str]:
    """``styles`` (names inside a block) as names inside its submodule ``rel``."""
    if not rel:
        return styles
    prefix = rel + "."
    return {("" if n == rel else n[len(prefix) :]): s for n, s in styles.items() if n == rel or n.startswith(prefix)}


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    # parallelize_module replaces each module's parameter by a new DTensor parameter, which breaks
    # weight tying (an embedding and an output head sharing one matrix). Both get Shard(0) on the
    # tp mesh, so pointing the others at the first restores the tie with consistent placements.
    for names in tied:
        first_owner, first_attr = names[0].rsplit(".", 1)
        shared = getattr(model.get_submodule(first_owner), first_attr)
        for other in names[1:]:
            owner, attr = other.rsplit(".", 1)
            current = getattr(model.get_submodule(owner), attr)
            if getattr(current, "placements", None) != getattr(shared, "placements", None):
                raise ValueError(
                    f"Tied parameters {names[0]!r} and {other!r} got different tensor-parallel placements; give "
                    "both modules the same style in tensor_parallel_plan ('embedding' and 'colwise_gather' both shard the vocabulary)."
                )
            setattr(model.get_submodule(owner), attr, shared)
