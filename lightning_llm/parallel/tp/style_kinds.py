"""What each tensor-parallel style is, defined once: the properties the planner, the coverage check, the region
finder and the first-forward checks ask of a style.

Plans stay dictionaries of style names (they come from YAML, the strategy's arguments and Hugging Face's
``_tp_plan``); :func:`kind_of` turns a name, parameterized forms (``fused_colwise:32,8,8``, ``replicate_shared:4``)
included, into its :class:`StyleKind`. :mod:`.styles` builds the torch ``ParallelStyle`` for each.
"""

from __future__ import annotations

from dataclasses import dataclass

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
