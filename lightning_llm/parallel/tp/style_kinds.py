"""What a tensor-parallel plan's entries mean, defined once: what each style is, what Hugging Face's style names
become, and which module names each pattern names.

Plans stay dictionaries of fnmatch patterns over dotted module names (``"layers.*.attention.q_proj"``) to style
names (they come from YAML, the strategy's arguments and Hugging Face's ``_tp_plan``). :func:`kind_of` turns a style
name, parameterized forms (``fused_colwise:32,8,8``, ``replicate_shared:4``) included, into its :class:`StyleKind`:
the properties the planner, the coverage check, the region finder and the first-forward checks ask of a style;
:mod:`.styles` builds the torch ``ParallelStyle`` for each. :func:`matches` and :func:`coverer` answer which names an
entry names, the one way every part of tensor parallelism asks it.

Hugging Face's ``_tp_plan`` style strings: transformers 5.17 to 5.24 register them in
``transformers.distributed.tensor_parallel`` (``ALL_PARALLEL_STYLES``) and ``transformers.distributed.expert_parallel``.
Every one is listed in :data:`HF_STYLES` or :data:`HF_REFUSED`: translated to one of our styles (the result of HF's
``ParallelStyle``), or refused before training with the entry and a plan that works instead
(:func:`hf_plan_entries`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_llm._compat.torch import module_parameters
from lightning_llm._compat.transformers import tp_plan

FUSED_PREFIX = "fused_colwise:"
SHARED_PREFIX = "replicate_shared:"


@dataclass(frozen=True)
class StyleKind:
    """The properties of one style.

    Attributes:
        name: the style's name in plans (a parameterized style: its prefix's form, e.g. ``fused_colwise:A,B,...``).
        opens: starts a head-sharded region: each rank gets its heads (columns) of the output.
        closes: ends a region: each rank multiplies its share of the input, the output is summed over tp.
        owns_subtree: the entry also plans everything under the module (no other source plans inside it).
        whole: the module's parameters stay whole on every rank (nothing of it is split).
        back_to_shards: under sequence parallelism its output goes back onto the sequence-sharded stream.
        doc: what it does, for the error that lists the styles.

    Example::

        kind_of("fused_colwise:32,8,8").opens   # True
    """

    name: str
    opens: bool = False
    closes: bool = False
    owns_subtree: bool = False
    whole: bool = False
    back_to_shards: bool = False
    doc: str = ""


KINDS: dict[str, StyleKind] = {
    kind.name: kind
    for kind in (
        StyleKind("colwise", opens=True, doc="output features split (q/k/v, gate/up)"),
        StyleKind("rowwise", closes=True, back_to_shards=True, doc="input features split, output summed (o, down)"),
        StyleKind("colwise_gather", doc="output features split, then gathered (the output head)"),
        StyleKind("rowwise_split_input", back_to_shards=True, doc="a row split whose input arrives whole"),
        StyleKind("embedding", doc="vocabulary rows split"),
        StyleKind("embedding_colwise", doc="embedding width split"),
        StyleKind("sequence_parallel", whole=True, doc="whole, on sequence shards under SP (norms)"),
        StyleKind("replicate", owns_subtree=True, whole=True, doc="kept whole on every rank, with its subtree"),
        StyleKind("replicate_grad_sum", whole=True, doc="whole, applied to this rank's heads, gradient summed"),
        StyleKind("fused_qkv", opens=True, doc="a fused [q | k | v], sizes from the head counts"),
        StyleKind(FUSED_PREFIX + "A,B,...", opens=True, doc="a fused projection of parts of the given sizes"),
        StyleKind(FUSED_PREFIX + "N", opens=True, doc="a fused projection of N equal parts"),
        StyleKind("experts", owns_subtree=True, doc="whole experts per tp rank"),
        StyleKind("expert_parallel", owns_subtree=True, doc="whole experts per ep rank (expert parallelism)"),
        StyleKind("gather_sequence", whole=True, doc="the whole sequence inside it under SP (an MoE block)"),
        StyleKind("positions", whole=True, doc="a position table added whole to the stream, replicated under SP"),
        StyleKind("colwise_replicated_input", opens=True, doc="a column split whose input is whole even under SP"),
        StyleKind("replicate_shared", doc="whole, its head-facing columns' gradient summed (multi-query k/v)"),
        StyleKind(SHARED_PREFIX + "N", doc="as replicate_shared, for the last N output columns"),
        StyleKind("per_head", owns_subtree=True, whole=True, doc="a list of one module per head, run per rank"),
        StyleKind("multihead_attention", owns_subtree=True, doc="nn.MultiheadAttention split by heads"),
    )
}


def kind_of(style: str | None) -> StyleKind | None:
    """The kind of ``style`` (``None`` for a name that is no style)."""
    if not isinstance(style, str):
        return None
    if style.startswith(FUSED_PREFIX):
        return KINDS[FUSED_PREFIX + "A,B,..."]
    if style.startswith(SHARED_PREFIX):
        return KINDS[SHARED_PREFIX + "N"]
    return KINDS.get(style)


def opens(style: str | None) -> bool:
    """Whether ``style`` starts a head-sharded region (a column split, fused or not)."""
    kind = kind_of(style)
    return kind is not None and kind.opens


def closes(style: str | None) -> bool:
    """Whether ``style`` ends a head-sharded region (a row split)."""
    kind = kind_of(style)
    return kind is not None and kind.closes


def owns_subtree(style: str | None) -> bool:
    """Whether an entry of ``style`` also plans everything under its module."""
    kind = kind_of(style)
    return kind is not None and kind.owns_subtree


def back_to_shards(style: str | None) -> bool:
    """Whether, under sequence parallelism, ``style``'s output goes back onto the sequence-sharded stream."""
    kind = kind_of(style)
    return kind is not None and kind.back_to_shards


def whole(style: str | None) -> bool:
    """Whether ``style`` keeps its module's parameters whole on every rank."""
    kind = kind_of(style)
    return kind is not None and kind.whole


def dataflow_role(style: str | None) -> str | None:
    """How planning classes a module of ``style`` in the dataflow (:mod:`lightning_llm.modeling.tp_shares`):
    "opens" (its output is split by heads/columns), "closes" (its output is back on the stream), "gathers" (its
    split output is gathered whole), or ``None``."""
    kind = kind_of(style)
    if kind is None:
        return None
    if kind.opens:
        return "opens"
    if kind.closes or kind.name in ("rowwise_split_input", "embedding"):  # an embedding's rows: output summed
        return "closes"
    return "gathers" if kind.name == "colwise_gather" else None


def matches(name: str, pattern: str) -> bool:
    """Whether the module name ``name`` matches the plan pattern ``pattern`` (case-sensitive fnmatch).

    Example::

        matches("layers.3.attention.q_proj", "layers.*.attention.q_proj")  # True
    """
    return fnmatch.fnmatchcase(name, pattern)


def coverer(plan: dict[str, str]) -> Callable[[str], bool]:
    """Whether a module name is named by ``plan``, directly or under an entry that owns its subtree.

    Example::

        covered = coverer({"layers.*.mlp": "replicate"})
        covered("layers.0.mlp.up_proj")  # True: 'replicate' keeps the whole subtree
    """
    owners = [p for p, s in plan.items() if owns_subtree(s)]

    def covered(name: str) -> bool:
        if any(matches(name, p) for p in plan):
            return True
        parts = name.split(".")
        return any(matches(".".join(parts[:k]), p) for p in owners for k in range(1, len(parts)))

    return covered


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
    return {p: s for p, s in plan.items() if any(matches(n, p) for n in names)}


def _without_expert_weights(root: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` without the entries naming a parameter of a ``moe_tp_experts`` module (split with the module)."""
    modules = dict(root.named_modules())
    experts = [p for p, s in plan.items() if s == "moe_tp_experts"]

    def expert_weight(pattern: str, style: str) -> bool:
        owner, _, leaf = pattern.rpartition(".")
        if style not in _EXPERT_WEIGHT_STYLES or owner not in experts:
            return False
        return any(matches(n, owner) and leaf in module_parameters(m) for n, m in modules.items())

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
