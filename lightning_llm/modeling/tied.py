"""Which parameters of a model are one tensor under several names (tied weights)."""

from __future__ import annotations

from torch import nn


def tied_parameter_names(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. tied input and output embeddings).

    Example::

        tied_parameter_names(gpt2)   # [["transformer.wte.weight", "lm_head.weight"]]
    """
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
