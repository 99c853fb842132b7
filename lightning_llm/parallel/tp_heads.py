"""Attention head counts under tensor parallelism: checked against tp before anything changes, then divided.

Column-split q/k/v give each rank ``heads / tp`` whole heads only when both the query and the
key/value head counts divide by ``tp``; otherwise the first forward fails in a reshape (or, with a
count that still divides the width, mixes halves of heads). Counts live on attention modules
(``self.num_heads``) or on a config object the modules read (HF ``config.num_key_value_heads``,
litgpt ``config.n_query_groups``).
"""

from __future__ import annotations

from torch import nn

HEAD_ATTRS = (
    "num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_kv_heads",
    "n_kv_head", "n_query_groups",
)


def _counts(obj: object) -> dict[str, int]:
    found = {}
    for attr in HEAD_ATTRS:
        value = getattr(obj, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found[attr] = value
    return found


def check_head_counts(model: nn.Module, blocks: nn.ModuleList, tp: int) -> None:
    """Raise ValueError naming the module, the count and ``tp`` if a query or KV head count does not divide by ``tp``.

    Example::

        check_head_counts(model, blocks, tp=4)  # ValueError if num_key_value_heads=2
    """
    places: list[tuple[str, object]] = [(f"{name or 'block 0'}", m) for name, m in blocks[0].named_modules()]
    places += [(f"{name or 'model'}.config", m.config) for name, m in model.named_modules() if hasattr(m, "config")]
    places += [(f"{name or 'block 0'}.config", m.config) for name, m in blocks[0].named_modules() if hasattr(m, "config")]
    for where, obj in places:
        counts = _counts(obj)
        bad = {a: v for a, v in counts.items() if v % tp}
        if bad:
            attr, value = next(iter(bad.items()))
            raise ValueError(
                f"{where}.{attr}={value} is not divisible by tensor_parallel_size={tp} (head counts there: {counts}); "
                f"each tensor-parallel rank must hold whole heads. Use a tensor_parallel_size that divides "
                f"{sorted(set(counts.values()))}, e.g. {_largest_divisor(list(counts.values()), tp)}."
            )


def _largest_divisor(values: list[int], tp: int) -> int:
    return max(d for d in range(1, tp + 1) if all(v % d == 0 for v in values))


def divide_head_counts(blocks: list[nn.Module], tp: int) -> int:
    """Divide integer head-count attributes (``num_heads``, ``n_kv_heads``, ...) of block submodules by ``tp``.

    Attention code that reshapes with a stored head count must see the local count once q/k/v
    are split column-wise. Returns how many attributes were changed.
    """
    changed = 0
    for block_idx, block in enumerate(blocks):
        for name, module in block.named_modules():
            for attr, value in _counts(module).items():
                if value % tp:
                    raise ValueError(
                        f"{name or 'block'}.{attr}={value} in block {block_idx} is not divisible by "
                        f"tensor_parallel_size={tp}; choose a tensor_parallel_size that divides the head counts."
                    )
                setattr(module, attr, value // tp)
                changed += 1
    return changed
