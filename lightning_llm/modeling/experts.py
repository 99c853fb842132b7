"""Mixture-of-experts layers as the rest of the package finds them: by structure, not by model name.

An experts module keeps an int ``num_experts`` and holds its expert weights itself, stacked with experts first and
at least one 3-D (Hugging Face transformers 5's ``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3NaiveMoe``,
the reference model's :class:`~lightning_llm.models.moe.Experts`), or is a ``ModuleList`` of identical modules named
like experts, one per expert (litgpt's ``LLaMAMoE``). Expert and tensor parallelism split them, the
planner divides them by the expert-parallel size, and FLOP accounting counts only the ``top_k`` of them a token uses.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)
TOP_K_NAMES = ("top_k", "num_experts_per_tok")
CONFIG_TOP_K_NAMES = ("num_experts_per_tok", "n_expert_per_token")  # Hugging Face's, litgpt's


def is_expert_list(module: nn.Module) -> bool:
    """A ``ModuleList`` of at least two modules of one class with the same parameter names and shapes (``None``
    slots, which x-transformers keeps in its per-layer lists, make it no list of experts)."""
    entries = list(module.children()) if isinstance(module, nn.ModuleList) else []
    if len(entries) < 2 or len(entries) != len(module):  # children() skips None slots; len() counts them
        return False
    shapes = [(type(m), [(n, tuple(p.shape)) for n, p in m.named_parameters()]) for m in entries]
    return bool(shapes[0][1]) and all(s == shapes[0] for s in shapes)


def named_like_experts(name: str) -> bool:
    """A module name whose last part says routed experts (``experts``, ``moe_experts``; not ``shared_experts``)."""
    leaf = name.rpartition(".")[2]
    return "expert" in leaf and "shared" not in leaf


def expert_count(module: nn.Module) -> int | None:
    """The number of experts of an experts module (``num_experts`` with 3-D weights), else ``None``.

    Every parameter must be the module's own with the experts as its first dimension: a submodule's
    parameters (a shared norm, an identity expert) would otherwise be split by a dimension that is not experts.
    """
    count = getattr(module, "num_experts", None)
    weights = list(module.parameters(recurse=False))
    if not isinstance(count, int) or not weights or len(list(module.parameters())) != len(weights):
        return None
    # At least one 3-D weight: a router also holds ``num_experts`` and an (experts x dim) weight.
    experts_first = all(p.dim() >= 2 and p.shape[0] == count for p in weights)
    return count if experts_first and any(p.dim() >= 3 for p in weights) else None


def routed_top_k(root: nn.Module, experts_name: str) -> int | None:
    """How many experts each token is routed to in the MoE layer holding ``experts_name``: an int ``top_k`` or
    ``num_experts_per_tok`` on the layer or one of its submodules (the router), else on the model's config."""
    parent = root.get_submodule(experts_name.rpartition(".")[0])
    for module in parent.modules():
        for attr in TOP_K_NAMES:
            if isinstance(getattr(module, attr, None), int):
                return getattr(module, attr)
    for module in [parent, *root.modules()]:
        config = getattr(module, "config", None)
        for attr in CONFIG_TOP_K_NAMES:
            if isinstance(getattr(config, attr, None), int):
                return getattr(config, attr)
    return None


def inactive_expert_parameters(root: nn.Module) -> int:
    """Expert parameters a token does not use: ``(E - k) / E`` of every experts module's (0 for a dense model).

    Model FLOPs count active parameters (``6 * N_active`` per token): a top-2-of-8 MoE does a quarter of its experts'
    matmuls per token. An MoE layer whose ``k`` cannot be found counts every expert as active, with a warning.

    Example::

        active = sum(p.numel() for p in model.parameters()) - inactive_expert_parameters(model)
    """
    inactive = 0
    for name, module in root.named_modules():
        count, params = expert_count(module), list(module.parameters(recurse=False))
        if count is None and is_expert_list(module) and named_like_experts(name):  # one module per expert
            count, params = len(module), list(module.parameters())
        if count is None or not name:
            continue
        k = routed_top_k(root, name)
        if k is None:
            log.warning("MoE layer %r: no top_k / num_experts_per_tok found; FLOPs count all its experts", name)
            continue
        inactive += sum(p.numel() for p in params) * (count - min(k, count)) // count
    return inactive
