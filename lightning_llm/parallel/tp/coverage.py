"""What tensor parallelism splits and what it leaves whole: refused before training, reported after.

A TP run that leaves most of each block whole on every rank pays TP's communication and gets little of its
memory saving. :func:`check_coverage` runs on the resolved plan, before anything changes, and refuses a
module inside the blocks that no plan entry names, that would stay whole on every rank and that holds
more than :data:`MAX_WHOLE_SHARE` of its block's parameters (or that inference could not classify while
its siblings are split, which would compute something else). Modules a plan keeps whole on purpose
(``replicate``: the user's ``tensor_parallel_replicate``, a router, multi-query k/v) pass and are reported.

:func:`coverage_lines` reads the local shards once TP is applied: per distinct block class, the share of
each part's parameters a rank holds (``self_attn 50%/rank, mlp.experts 50%/rank, replicated: ...``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm.modeling.blocks import block_kind, block_modules, block_names
from lightning_llm.parallel.tp.style_kinds import matches, owns_subtree, whole

MAX_WHOLE_SHARE = 0.05


def _styles_of(name: str, plan: dict[str, str]) -> list[str]:
    """The styles of the entries naming ``name`` itself, or an ancestor that owns its subtree."""
    parts = name.split(".")
    direct = [s for p, s in plan.items() if matches(name, p)]
    inherited = [
        s for p, s in plan.items() if owns_subtree(s) for k in range(1, len(parts)) if matches(".".join(parts[:k]), p)
    ]
    return direct + inherited


def check_coverage(
    blocks_name: str, blocks: nn.ModuleList, plan: dict[str, str], unknown: dict[str, str], tp: int
) -> None:
    """Refuse, before training, a sizeable part of a block that TP would silently leave whole on every rank.

    Example::

        check_coverage("model.layers", model.layers, plan, resolved.unknown, tp=2)
    """
    named = list(zip(block_names(blocks_name, blocks), block_modules(blocks)))
    split = lambda styles: any(not whole(s) for s in styles)  # noqa: E731
    if not any(split(_styles_of(f"{n}.{rel}", plan)) for n, b in named for rel, _ in b.named_modules() if rel):
        raise ValueError(
            f"tensor_parallel_size={tp} but nothing inside the blocks at {blocks_name!r} is split: they contain no "
            "nn.Linear (or Conv1D) layer to shard that a plan or inference can split. Pass `tensor_parallel_plan` "
            "to the strategy, or use tensor_parallel_size=1."
        )
    seen: set[tuple] = set()
    for block_name, block in named:
        if block_kind(block) in seen or getattr(block, "is_pipeline_placeholder", False):
            continue
        same_class = [n for n, b in named if block_kind(b) == block_kind(block)]
        seen.add(block_kind(block))
        total = sum(p.numel() for p in block.parameters()) or 1
        for rel, module in block.named_modules():
            name = f"{block_name}.{rel}" if rel else block_name
            own = sum(p.numel() for p in module.parameters(recurse=False))
            if not own or _styles_of(name, plan):
                continue
            why = unknown.get(name)
            if own / total > MAX_WHOLE_SHARE or (why and _has_split_sibling(block, rel, plan, block_name)):
                refusal = _refusal(name, _whole_part(name, rel, module, same_class), own / total, why, tp)
                raise ValueError(refusal + _plan_so_far(plan, wildcard_index(name)))


def _has_split_sibling(block: nn.Module, rel: str, plan: dict[str, str], block_name: str) -> bool:
    parent = rel.rpartition(".")[0]
    owner = block.get_submodule(parent) if parent else block
    prefix = f"{block_name}.{parent}." if parent else f"{block_name}."
    return any(not whole(s) for child, _ in owner.named_children() for s in _styles_of(prefix + child, plan))


def _whole_part(name: str, rel: str, module: nn.Module, same_class: list[str]) -> list[str]:
    """What to keep whole with ``name``: the part holding a leaf layer (its siblings must not be split without it);
    the blocks of its class when it sits directly in the block."""
    if any(True for _ in module.children()):
        return [wildcard_index(name)]
    if "." in rel:
        return [wildcard_index(name.rpartition(".")[0])]
    return same_class if len(same_class) < 8 else [wildcard_index(same_class[0])]


def _refusal(name: str, keep: list[str], share: float, why: str | None, tp: int) -> str:
    return (
        f"tensor_parallel_size={tp} would leave {wildcard_index(name)!r} ({share:.0%} of its block's parameters) whole on "
        f"every rank: no tensor-parallel plan names it"
        + (f" and inference cannot split it ({why})" if why else "")
        + f". Split it with a tensor_parallel_plan entry for {wildcard_index(name)!r}, or keep it whole on purpose "
        f"with tensor_parallel_replicate={keep!r} (the whole part; parts of a module split and parts whole "
        "would compute something else), or use pipeline_parallel_size / zero_stage instead of tensor parallelism."
    )


def _plan_so_far(plan: dict[str, str], missing: str, limit: int = 40) -> str:
    """The resolved plan with the missing entry to fill in: the user's entries extend it, so one entry is enough."""
    entries = [f"    {p!r}: {s!r}," for p, s in plan.items()]
    if len(entries) > limit:  # a hybrid stack's per-layer entries: the missing one is always shown
        entries = [*entries[:limit], f"    # ... {len(entries) - limit} more"]
    shown = [*entries, f"    {missing!r}: STYLE,  # <- the missing entry"]
    return (
        "\nThe plan resolved so far, with the entry to add (a tensor_parallel_plan you pass extends it: the one "
        "missing entry is enough):\n{\n" + "\n".join(shown) + "\n}"
    )


def wildcard_index(name: str) -> str:
    """``model.layers.3.self_attn`` -> ``model.layers.*.self_attn``: the first index made a wildcard."""
    parts = name.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            parts[k] = "*"
            break
    return ".".join(parts)


def _local_share(params: list, elsewhere: int = 0) -> float | None:
    """This rank's share of ``params`` plus ``elsewhere`` elements only other ranks hold (a ModuleList's experts
    under expert parallelism)."""
    total = sum(p.numel() for p in params) + elsewhere
    if not total:
        return None
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return local / total


def _elsewhere(module: nn.Module) -> int:
    return sum(getattr(m, "elements_elsewhere", 0) for m in module.modules())


def _parts(module: nn.Module, prefix: str = "") -> list[tuple[str, float]]:
    """(part name, local share) for each child; a child whose parameters are split unevenly is opened up."""
    parts = []
    own = list(module.parameters(recurse=False))
    if own and prefix:
        parts.append((f"{prefix}(own)", _local_share(own)))
    for name, child in module.named_children():
        params = list(child.parameters())
        share = _local_share(params, _elsewhere(child))
        if share is None:
            continue
        shares = {round(_local_share([p]), 4) for p in params}
        if len(shares) > 1 and any(True for _ in child.children()):
            parts.extend(_parts(child, f"{prefix}{name}."))
        else:
            parts.append((f"{prefix}{name}", share))
    return parts


def coverage_lines(blocks: list[nn.Module]) -> list[str]:
    """One line per distinct kind of block (class and parameter names: DeepSeek-V3's dense and MoE blocks share a
    class): each part's share held by this rank, whole parts listed last.

    Example::

        coverage_lines(owned_blocks)  # ["LlamaDecoderLayer x2: self_attn 50%/rank, mlp 50%/rank; replicated: ..."]
    """
    lines = []
    kinds: dict[tuple, list[nn.Module]] = {}
    for block in blocks:
        kinds.setdefault(block_kind(block), []).append(block)
    for (cls, _), members in kinds.items():
        parts = _parts(members[0])
        split = [f"{n} {s:.0%}/rank" for n, s in parts if s < 1]
        whole = [n for n, s in parts if s >= 1]
        share = _local_share(list(members[0].parameters()), _elsewhere(members[0]))
        lines.append(
            f"{cls.__name__} x{len(members)} ({share:.0%} of its parameters on this rank): "
            + (", ".join(split) or "nothing split")
            + (f"; replicated: {', '.join(whole)}" if whole else "")
        )
    return lines
