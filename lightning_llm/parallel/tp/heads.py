"""Attention head counts under tensor parallelism: checked against tp before anything changes, then divided.

Column-split q/k/v give each rank ``heads / tp`` whole heads only when both the query and the
key/value head counts divide by ``tp``; otherwise the first forward fails in a reshape (or, with a
count that still divides the width, mixes halves of heads). Counts live on attention modules
(``self.num_heads``) or on a config object the modules read (HF ``config.num_key_value_heads``,
litgpt ``config.n_query_groups``).

They are read with :func:`attribute` and :func:`int_attribute`, whatever holds them. A config may refuse a read:
Hugging Face's heterogeneous configs (Gemma 4, dots3) hold some settings per layer and raise
``AmbiguousGlobalPerLayerAttributeError`` when one of them is read globally (``config.num_key_value_heads``); the
layer's own value is in ``config.per_layer_config[i]``. A refused or missing attribute reads as absent, and
:func:`layer_configs` gives the per-layer configs where a config has them.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

HEAD_ATTRS = (
    "heads",
    "num_heads",
    "n_heads",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "n_kv_head",
    "n_query_groups",
)

KV_HEAD_ATTRS = HEAD_ATTRS[HEAD_ATTRS.index("num_key_value_heads") :]


def _counts(obj: object) -> dict[str, int]:
    found = {}
    for attr in HEAD_ATTRS:
        value = attribute(obj, attr)
        if isinstance(value, int) and not isinstance(value, bool):
            found[attr] = value
    return found


def check_head_counts(
    model: nn.Module, split_parts: list[tuple[str, nn.Module]], tp: int, shared_kv: bool = False
) -> None:
    """Raise ValueError naming the module, the count and ``tp`` if a query or KV head count does not divide by ``tp``.

    ``split_parts`` are (name, module) of the parts of blocks whose heads are split (see
    :func:`lightning_llm.parallel.tp.apply.head_split_parts`); parts kept whole are not checked.
    ``shared_kv``: the plan gives every rank the whole single key/value head (multi-query attention), so
    a key/value count of 1 is not split.

    Example::

        check_head_counts(model, [("layers.0.attention", attention)], tp=4)  # ValueError if num_key_value_heads=2
    """
    if not split_parts:
        return
    places: list[tuple[str, object]] = []
    for part_name, part in split_parts:
        places += [(f"{part_name}.{name}" if name else part_name, m) for name, m in part.named_modules()]
        places += [
            (f"{part_name}.{n}.config" if n else f"{part_name}.config", m.config)
            for n, m in part.named_modules()
            if hasattr(m, "config")
        ]
    places += [(f"{name or 'model'}.config", m.config) for name, m in model.named_modules() if hasattr(m, "config")]
    places += [  # a heterogeneous config's per-layer values (Gemma 4's key/value heads per layer)
        (f"{where}.per_layer_config[{i}]", layer)
        for where, config in list(places)
        for i, layer in enumerate(layer_configs(config))
    ]
    for where, obj in places:
        counts = _counts(obj)
        bad = {a: v for a, v in counts.items() if v % tp and not (shared_kv and v == 1 and a in KV_HEAD_ATTRS)}
        if bad:
            attr, value = next(iter(bad.items()))
            raise ValueError(
                f"{where}.{attr}={value} is not divisible by tensor_parallel_size={tp} (head counts there: {counts}); "
                f"each tensor-parallel rank must hold whole heads. Use a tensor_parallel_size that divides "
                f"{sorted(set(counts.values()))}, e.g. {_largest_divisor(list(counts.values()), tp)}."
            )


def block_head_counts(block: nn.Module) -> set[int]:
    """Every head count a module of ``block`` (or a config one holds) states, as the block's forward reads them now.

    Example::

        block_head_counts(model.layers[0])   # {32, 8}: query and key/value heads
    """
    counts = set()
    for module in block.modules():
        for owner in (module, getattr(module, "config", None)):
            counts.update(_counts(owner).values() if owner is not None else ())
    return counts


def localize_part_widths(owner: nn.Module, sizes: tuple[int, ...], shared: tuple[bool, ...], tp: int) -> list[str]:
    """Set each attribute of ``owner`` that holds the widths its forward cuts a fused output into (ints adding up to
    the output, each the sum of consecutive ``sizes``) to this rank's widths; return the attributes set.

    The forward cuts the rank's share of the output by them (PaLM's ``split(self.fused_dims, dim=-1)``); a part in
    ``shared`` stays whole on every rank, the others are divided by ``tp``. Example::

        localize_part_widths(block.fn, (32, 8, 8, 128, 128), (False, True, True, False, False), tp=2)
        # block.fn.fused_dims: (32, 8, 8, 256) -> (16, 8, 8, 128)
    """
    local = [size if whole else size // tp for size, whole in zip(sizes, shared)]
    changed = []
    for attr, value in list(vars(owner).items()):
        if not isinstance(value, (tuple, list)) or len(value) < 2 or any(type(v) is not int for v in value):
            continue
        widths = _merged(value, sizes, local) if sum(value) == sum(sizes) else None
        if widths is not None and widths != list(value):
            setattr(owner, attr, type(value)(widths))
            changed.append(attr)
    return changed


def _merged(value: tuple[int, ...] | list[int], sizes: tuple[int, ...], local: list[int]) -> list[int] | None:
    """``local`` summed over the runs of consecutive ``sizes`` adding up to each entry of ``value``; else ``None``."""
    out, i = [], 0
    for width in value:
        total = here = 0
        while total < width and i < len(sizes):
            total, here, i = total + sizes[i], here + local[i], i + 1
        if total != width:
            return None
        out.append(here)
    return out


def _largest_divisor(values: list[int], tp: int) -> int:
    return max(d for d in range(1, tp + 1) if all(v % d == 0 for v in values))


def divide_head_counts(
    blocks: list[nn.Module], tp: int, owners: set[str] | None = None, done: set[int] | None = None
) -> int:
    """Divide the head counts that the attention code of each block reads by ``tp``; return how many changed.

    Attention code that reshapes or slices with a stored head count must see the local count once
    q/k/v are split column-wise. ``owners`` names (inside a block) the modules whose projections are
    split (see :func:`.coverage.region_owners`); counts are divided on them, their
    submodules and the block itself, not where attention stays whole (a gathered plan). Counts are
    read from module attributes (``self.num_heads``), from a config object the module holds (litgpt's
    ``self.config.n_head``, Phi-3's ``self.config.num_attention_heads``: the module gets its own copy
    of the config with the local counts, so the model's own config is unchanged), and from the
    per-rank widths some classes keep (:data:`WIDTH_ATTRS`). ``done`` holds the ids of modules already divided
    (one module called from several blocks, Zamba's shared transformer, is divided once); this call adds to it.
    """
    changed = 0
    copies: dict[int, object] = {}
    done = set() if done is None else done
    for block_idx, block in enumerate(blocks):
        for name, module in block.named_modules():
            if owners is not None and name and not any(name == o or name.startswith(o + ".") or not o for o in owners):
                continue
            if id(module) in done or getattr(type(module), "heads_divided", False):
                continue
            done.add(id(module))
            where = f"{name or 'block'}.{{}} in block {block_idx}"
            changed += _divide(module, _counts(module), tp, where)
            changed += _divide(
                module, {a: getattr(module, a) for a in WIDTH_ATTRS.get(type(module).__name__, ())}, tp, where
            )
            config = getattr(module, "config", None)
            if config is not None and _counts(config):
                if id(config) not in copies:
                    copies[id(config)] = copy.copy(config)
                    changed += _divide(
                        copies[id(config)], _counts(config), tp, f"{name or 'block'}.config.{{}} in block {block_idx}"
                    )
                module.config = copies[id(config)]
    return changed


# Widths (not head counts) that some classes keep and slice with: GPT-2 splits c_attn's output by split_size; a
# GroupNorm inside the split attention (RetNet's, one group per head over the merged heads) normalizes this rank's
# heads, so its groups and channels are this rank's too.
WIDTH_ATTRS = {"GPT2Attention": ("split_size", "embed_dim"), "GroupNorm": ("num_groups", "num_channels")}


def _divide(obj: object, values: dict[str, int], tp: int, where: str) -> int:
    values = {a: v for a, v in values.items() if not (v == 1 and a in KV_HEAD_ATTRS)}  # one k/v head: shared whole
    for attr, value in values.items():  # set from the originals: HF configs alias names (n_head = num_attention_heads)
        if value % tp:
            raise ValueError(
                f"{where.format(f'{attr}={value}')} is not divisible by tensor_parallel_size={tp}; choose a tensor_parallel_size "
                "that divides the head counts."
            )
        setattr(obj, attr, value // tp)
    return len(values)


def attribute(owner: object, name: str) -> Any:
    """``getattr(owner, name)``, or ``None`` where it is missing or the owner refuses the read (a property raising)."""
    if owner is None:
        return None
    try:
        return getattr(owner, name, None)
    except Exception:  # a config refusing a global read of a per-layer value
        return None


def int_attribute(owners: list, names: tuple[str, ...]) -> int | None:
    """The first integer (not bool) found among ``names`` on ``owners``, in order; ``None`` if none.

    Example::

        int_attribute([attention, config], ("num_key_value_heads", "n_kv_heads"))   # 8
    """
    for owner in owners:
        for name in names:
            value = attribute(owner, name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def layer_configs(config: object) -> list:
    """The per-layer configs of a heterogeneous config (``config.per_layer_config``), else an empty list."""
    if not attribute(config, "is_heterogeneous"):
        return []
    try:
        return list(attribute(config, "per_layer_config") or [])
    except Exception:
        return []
