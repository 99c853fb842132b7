"""Parameters a TP plan leaves whole inside the head-sharded region of a block: found, summed, verified.

Between a column-split layer (``colwise``: each rank gets its own heads or MLP columns) and the
row-split layer that closes it (``rowwise``), activations are per-rank pieces. A module there with
its own replicated parameters (Qwen3/Gemma3 per-head ``q_norm``/``k_norm``) gets on each rank only
its heads' share of the gradient; left alone, the copies drift apart silently. Outside that region
activations and their gradients are identical on all ranks (torch's TP all-reduces them at the
region's boundaries), so those parameters need nothing.

:func:`sharded_region_modules` finds such modules statically (they sit under the module holding
both the column- and the row-split layers, e.g. ``self_attn``) so they can get the
``replicate_grad_sum`` style before FSDP and the optimizer see the parameters. Because "under
``self_attn``" is not proof of "applied to sharded activations" (a pre-norm could live there),
:func:`verify_on_first_forward` checks the real execution order in the first forward and stops
training with the module's name before a wrong gradient is ever applied.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm.parallel.tp.coverage import wildcard_index
from lightning_llm.parallel.tp.fused import projection_dims
from lightning_llm.parallel.tp.style_kinds import closes, opens


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
