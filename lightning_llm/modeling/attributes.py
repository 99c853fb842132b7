"""Reading integer settings (head counts, widths) off modules and configs whatever they are.

A config may refuse a read: Hugging Face's heterogeneous configs (Gemma 4, dots3) hold some settings per layer and
raise ``AmbiguousGlobalPerLayerAttributeError`` when one of them is read globally (``config.num_key_value_heads``);
the layer's own value is in ``config.per_layer_config[i]``. Readers here treat a refused or missing attribute as
absent, and :func:`layer_configs` gives the per-layer configs where a config has them.
"""

from __future__ import annotations

from typing import Any


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
