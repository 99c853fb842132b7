"""Hugging Face ``_tp_plan`` style strings and what each becomes here (or why it is refused).

transformers 5.17 to 5.24 register these styles in ``transformers.distributed.tensor_parallel``
(``ALL_PARALLEL_STYLES``) and ``transformers.distributed.expert_parallel``. Every one of them is
listed below: either translated to one of our styles (the result of HF's ``ParallelStyle``), or
refused before training with the entry and a plan that works instead.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from lightning_llm._compat.torch import module_parameters
from lightning_llm._compat.transformers import tp_plan

# HF style -> our style. Layouts as HF registers them (input, output of the module):
HF_STYLES = {
    "colwise": "colwise",  # Replicate -> Shard(-1)
    "rowwise": "rowwise",  # Shard(-1) -> Replicate
    "colwise_rep": "colwise_gather",  # Replicate -> Replicate
    "colwise_gather_output": "colwise_gather",
    "rowwise_rep": "rowwise_split_input",  # Replicate -> Replicate: each rank slices its input columns
    "rowwise_split_input": "rowwise_split_input",
    "embedding_rowwise": "embedding",  # vocabulary split
    "embedding_colwise": "embedding_colwise",  # embedding-dimension split, output gathered
    "sequence_parallel": "sequence_parallel",
    "replicated_with_grad_allreduce": "replicate_grad_sum",  # full copy, gradient summed over tp
    "replicate": "replicate",
    # Whole experts per tp rank (see .tp_experts) instead of HF's split of every expert's intermediate
    # dimension: exact, the same memory per rank, and the experts' 3-D weights stay contiguous shards.
    "moe_tp_experts": "experts",
}
# Styles HF gives the 3-D weights of an experts module; the module's own "experts" entry covers them.
_EXPERT_WEIGHT_STYLES = ("packed_colwise", "packed_rowwise", "colwise", "rowwise")

# HF styles we do not apply, and why; the refusal suggests leaving the whole parent module replicated.
HF_REFUSED = {
    "packed_colwise": "a fused (packed) projection whose halves HF shards with a strided layout",
    "packed_rowwise": "the output projection paired with a packed (fused) projection",
    "moe_identity_expert": "HF's expert-tensor-parallel identity expert",
    "mla_kv_a_proj": "multi-head latent attention's compressed KV projection",
    "all_reduce": "an all-reduce of a module output computed from partial inputs",
    "local_params": "HF's local-tensor view of parameters sharded by another entry (attention sinks)",
    "grouped_gemm": "expert parallelism (experts distributed over ranks)",
    "ep_dispatch_experts": "expert parallelism (token dispatch to experts on other ranks)",
    "ep_router": "expert parallelism (router feeding a token dispatch)",
    # transformers 5.17's DeepGEMM FP8xFP4 "Mega MoE" kernels (SM100+), with their own weight layout.
    "megamoe_experts": "experts run by DeepGEMM's FP8xFP4 Mega MoE kernel, in its own weight layout",
    "megamoe_router": "the router feeding DeepGEMM's Mega MoE experts",
}


def _parent(pattern: str) -> str:
    return pattern.rsplit(".", 1)[0] if "." in pattern else pattern


def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """The outermost Hugging Face ``_tp_plan`` on ``model`` or a submodule, translated to our style names.

    Entries whose style we do not apply are refused with a plan that works: the translated plan
    without every entry under the refused entry's parent module (that module then stays whole on
    each rank, which is exact), to pass as the strategy's ``tensor_parallel_plan``.

    Example::

        plan = hf_plan(lightning_module)  # {"model.model.layers.*.self_attn.q_proj": "colwise", ...}
    """
    entries = hf_plan_entries(model)
    if entries is None:
        return None
    translated, refused = entries
    if refused:
        raise ValueError(hf_refusal(translated, refused))
    return translated


def hf_plan_entries(model: nn.Module) -> tuple[dict[str, str], dict[str, str]] | None:
    """(translated entries, entries in HF styles we do not apply) of the outermost ``_tp_plan``, or ``None``.

    Patterns are full module names of ``model``; only entries that match one of its modules are kept.
    """
    for prefix, module in model.named_modules():
        plan = tp_plan(module)
        if not (isinstance(plan, dict) and plan):
            continue
        full = _present(module, _without_expert_weights(module, plan))
        full = {f"{prefix}.{p}" if prefix else p: s for p, s in full.items()}
        translated = {p: HF_STYLES[s] for p, s in full.items() if s in HF_STYLES}
        return translated, {p: s for p, s in full.items() if s not in HF_STYLES}
    return None


def _present(root: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entries matching a module of this model: an HF plan covers its whole family (Qwen3-MoE's names
    dense MLP layers that a config with every layer sparse does not have)."""
    names = [n for n, _ in root.named_modules() if n]
    return {p: s for p, s in plan.items() if any(fnmatch.fnmatchcase(n, p) for n in names)}


def _without_expert_weights(root: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` without the entries naming a parameter of a ``moe_tp_experts`` module (split with the module)."""
    modules = dict(root.named_modules())
    experts = [p for p, s in plan.items() if s == "moe_tp_experts"]

    def expert_weight(pattern: str, style: str) -> bool:
        owner, _, leaf = pattern.rpartition(".")
        if style not in _EXPERT_WEIGHT_STYLES or owner not in experts:
            return False
        return any(fnmatch.fnmatchcase(n, owner) and leaf in module_parameters(m) for n, m in modules.items())

    return {p: s for p, s in plan.items() if not expert_weight(p, s)}


def hf_refusal(translated: dict[str, str], refused: dict[str, str]) -> str:
    """Why the HF plan cannot be applied as it is, and a plan without the refused entries' modules that can."""
    parents = {_parent(p) for p in refused}
    keep = {p: s for p, s in translated.items() if not any(p == q or p.startswith(q + ".") for q in parents)}
    why = "; ".join(
        f"{p!r}: {s!r} ({HF_REFUSED.get(s, 'a style this package does not know')})" for p, s in refused.items()
    )
    return (
        f"The model's Hugging Face tensor-parallel plan has entries this package does not apply: "
        f"{why}. Keep those modules whole on every rank (exact, they are then only not split) by passing this plan "
        f"to the strategy: tensor_parallel_plan={keep!r}."
    )
