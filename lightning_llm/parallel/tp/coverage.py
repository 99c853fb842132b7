"""What tensor parallelism leaves whole: modules (refused before training, reported after) and parameters inside
a split region (their gradients summed over tp, the order verified in the first forward).

A TP run that leaves most of each block whole on every rank pays TP's communication and gets little of its
memory saving. :func:`check_coverage` runs on the resolved plan, before anything changes, and refuses a
module inside the blocks that no plan entry names, that would stay whole on every rank and that holds
more than :data:`MAX_WHOLE_SHARE` of its block's parameters (or that inference could not classify while
its siblings are split, which would compute something else). Modules a plan keeps whole on purpose
(``replicate``: the user's ``tensor_parallel_replicate``, a router, multi-query k/v) pass and are reported.
:func:`coverage_lines` reads the local shards once TP is applied: per distinct block class, the share of
each part's parameters a rank holds (``self_attn 50%/rank, mlp.experts 50%/rank, replicated: ...``).

Between a column-split layer (``colwise``: each rank gets its own heads or MLP columns) and the row-split layer that
closes it (``rowwise``), activations are per-rank pieces. A module there with its own whole parameters (Qwen3/Gemma3
per-head ``q_norm``/``k_norm``) gets on each rank only its heads' share of the gradient; left alone, the copies drift
apart silently. Outside that region activations and their gradients are identical on all ranks (torch's TP
all-reduces them at the region's boundaries), so those parameters need nothing. :func:`sharded_region_modules` finds
such modules statically (under the module holding both the column- and the row-split layers, e.g. ``self_attn``) so
they get the ``replicate_grad_sum`` style before FSDP and the optimizer see the parameters. Because "under
``self_attn``" is not proof of "applied to sharded activations" (a pre-norm could live there),
:func:`verify_on_first_forward` checks the real execution order in the first forward and stops training with the
module's name before a wrong gradient is ever applied.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm.modeling.blocks import block_kind, block_modules, block_names
from lightning_llm.parallel.tp.fused import projection_dims
from lightning_llm.parallel.tp.style_kinds import closes, matches, opens, owns_subtree, whole

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


def _lent_per_head(name: str, styles: dict[str, str]) -> bool:
    """Whether ``name`` is inside a list the plan runs per head (each rank its own entries, see :mod:`.attention_heads`)."""
    return any(s == "per_head" and name.startswith(n + ".") for n, s in styles.items())


def _owns_plain_params(module: nn.Module) -> bool:
    return any(not isinstance(p, DTensor) for p in module.parameters(recurse=False))


def region_owners(styles: dict[str, str]) -> set[str]:
    """Names of the smallest modules holding both a column-split layer and the row-split layer closing it.

    ``styles`` maps module names inside a block to their plan style; ``""`` is the block itself.
    """
    owners = set()
    for name, style in styles.items():
        if not opens(style):
            continue
        parts = name.split(".")
        for cut in range(len(parts) - 1, -1, -1):
            owner = ".".join(parts[:cut])
            if any(closes(styles.get(n)) and (not owner or n.startswith(owner + ".")) for n in styles):
                owners.add(owner)
                break
    return owners


def sharded_region_modules(block: nn.Module, styles: dict[str, str]) -> list[str]:
    """Names (inside ``block``) of modules with their own parameters, outside the plan, under a region owner.

    ``styles`` maps module names inside ``block`` to their plan style. A region owner is the
    smallest ancestor of a column-split layer that also contains a row-split layer.
    """
    owners = region_owners(styles)
    found = []
    for name, module in block.named_modules():
        if not name or name in styles or not _has_params(module) or _lent_per_head(name, styles):
            continue
        # The block itself is never a region owner here: its own norms see whole activations.
        inside = [o for o in owners if o and name.startswith(o + ".") and _between(block, o, name, styles)]
        holds_planned = any(n.startswith(name + ".") for n in styles)
        if inside and not holds_planned:
            found.append(name)
    return found


def _between(block: nn.Module, owner: str, name: str, styles: dict[str, str]) -> bool:
    """Whether ``name`` runs between the split layers of ``owner``: for an ``nn.Sequential`` owner (whose order is
    its children's), only children after the first column split and before the last row split; else assumed."""
    container = block.get_submodule(owner)
    if not isinstance(container, nn.Sequential):
        return True
    children = [c for c, _ in container.named_children()]
    position = {c: i for i, c in enumerate(children)}
    prefix = owner + "."

    def index(n: str) -> int:
        return position[n[len(prefix) :].split(".")[0]]

    opened = [index(n) for n, s in styles.items() if n.startswith(prefix) and opens(s)]
    closed = [index(n) for n, s in styles.items() if n.startswith(prefix) and closes(s)]
    return bool(opened and closed) and min(opened) < index(name) < max(closed)


def verify_on_first_forward(
    block: nn.Module, styles: dict[str, str], label: str, last: nn.Module | None = None
) -> None:
    """Check, in ``block``'s first forward, that exactly the modules run inside the region sum their gradients,
    and that none of them normalizes over the full width of the split heads (BitNet's ``attn_sub_norm``).

    ``last``: the module whose call ends the block's first forward, where the model does not call the block itself
    (its parts called one by one); the block by default.

    Each module is checked as it is called, before it runs, so a wrong layout stops with the module's name
    rather than a shape error inside it. Raises RuntimeError (before any optimizer step) naming the module
    and the plan entry that fixes it.
    """
    inside = False
    handles = []

    def enter(name: str, kind: str, module: nn.Module, args: tuple) -> None:
        nonlocal inside
        if kind == "open":
            inside = True
        elif kind == "close":
            inside = False
        elif inside and kind in ("plain", "replicate_grad_sum"):
            _check_width(label, name, module, args)
            if kind == "plain" and _owns_plain_params(module):
                raise RuntimeError(_message(label, name, "runs on head-sharded activations", "replicate_grad_sum"))
        elif not inside and kind == "replicate_grad_sum":
            raise RuntimeError(_message(label, name, "runs on activations that are whole on every rank", "replicate"))

    for name, module in block.named_modules():
        style = styles.get(name)
        if _lent_per_head(name, styles):
            continue
        if opens(style) or closes(style) or (name and _has_params(module)):
            kind = "open" if opens(style) else "close" if closes(style) else style or "plain"
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name, k=kind: enter(n, k, m, a)))

    def done(module, args, output):
        for handle in handles:
            handle.remove()

    handles.append((last or block).register_forward_hook(done))


def _check_width(label: str, name: str, module: nn.Module, args: tuple) -> None:
    """Parameters wider than the activation they read: a norm over all heads (BitNet's ``attn_sub_norm``), or a
    whole layer mixing all heads (Doge's ``dt_proj`` over every value head), run on this rank's heads."""
    width = args[0].shape[-1] if args and hasattr(args[0], "shape") and args[0].dim() else None
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters(recurse=False)]
    dims = projection_dims(module)  # a layer reads its input width; a norm or scale, its vectors' width
    sizes = {dims[0]} if dims else {p.shape[0] for p in local if p.dim() == 1}
    if width is not None and sizes and width not in sizes and max(sizes) > width:
        owner = name.rpartition(".")[0] or name
        raise RuntimeError(
            f"Tensor parallelism: {label}.{name} has {max(sizes)}-wide parameters but runs on this rank's "
            f"{width} columns of the split heads: it mixes (or normalizes) all heads, which no rank holds. "
            f"Keep the part around it whole: tensor_parallel_replicate=['{wildcard_index(f'{label}.{owner}')}'], or use "
            "pipeline parallelism or ZeRO for this model instead of tensor parallelism."
        )


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _message(label: str, name: str, where: str, style: str) -> str:
    return (
        f"Tensor parallelism: {label}.{name} keeps whole parameters but {where}, so its gradient "
        f"{'would differ between tp ranks' if style == 'replicate_grad_sum' else 'must not be summed over tp ranks'}. "
        f"Name it in the plan: tensor_parallel_plan={{'{label}.{name}': '{style}', ...}} "
        "(with the other entries), so its gradient is handled as the math requires."
    )
