"""Which tensor-parallel style each module gets: plans merged per module, never one taken on faith.

A plan maps fnmatch patterns over module names (``"layers.*.attention.q_proj"``) to one of
:data:`STYLES`. Four sources are merged, and for each module the first source that names it wins:

1. the strategy's ``tensor_parallel_plan`` argument (and its ``tensor_parallel_replicate`` opt-outs);
2. a ``tensor_parallel_plan()`` method on the LightningModule;
3. a Hugging Face ``_tp_plan`` on a submodule (its styles translated, see :mod:`.style_kinds`);
4. inference from the model's structure (:mod:`.infer`), for every module the others leave out.

A plan naming a module also owns what is inside it. HF plans often cover part of a model only (the
embedding and head; the experts), so taking the first plan found as the whole plan would leave the rest
whole on every rank without a word: :mod:`.coverage` reports and refuses what stays whole.

The entries sequence parallelism adds are in :mod:`.sequence_parallel_plan`, the pattern matching in
:mod:`.style_kinds`.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from lightning_llm.parallel.tp.experts import check_experts
from lightning_llm.parallel.tp.fused import FUSED_PREFIX, fused_sizes, parse_fused, projection_dims, qkv_style
from lightning_llm.parallel.tp.infer import infer_plan, infer_styles, known_fused_style, variant_plan
from lightning_llm.parallel.tp.multihead_attention import check_multihead_attention
from lightning_llm.parallel.tp.sequence_parallel_plan import (
    add_sequence_parallel_boundaries,
    add_sequence_parallel_norms,
)
from lightning_llm.parallel.tp.style_kinds import KINDS, coverer, hf_plan_entries, hf_refusal, kind_of, matches

__all__ = [
    "STYLES",
    "add_sequence_parallel_boundaries",
    "add_sequence_parallel_norms",
    "check_style",
    "infer_plan",
    "resolve_plan",
    "validate_plan",
]

STYLES = tuple(KINDS)


def is_fused_style(style: str) -> bool:
    return style == "fused_qkv" or style.startswith(FUSED_PREFIX)


def merge_plans(model: nn.Module, sources: list[tuple[str, dict[str, str]]]) -> tuple[dict[str, str], list[str]]:
    """The sources' entries, each kept only for the modules no earlier source names; and which sources gave any.

    An entry whose pattern matches some modules an earlier source names is written out for the others.
    """
    merged: dict[str, str] = {}
    used: list[str] = []
    names = [n for n, _ in model.named_modules() if n]
    for label, plan in sources:
        covered = coverer(merged)
        kept = {}
        for pattern, style in plan.items():
            matched = [n for n in names if matches(n, pattern)]
            free = [n for n in matched if not covered(n)]
            if len(free) == len(matched):
                kept[pattern] = style
            else:
                kept.update(dict.fromkeys(free, style))
        if kept:
            used.append(label)
        merged.update(kept)
    return merged, used


class ResolvedPlan(NamedTuple):
    """What :func:`resolve_plan` decided."""

    plan: dict[str, str]
    source: str
    unknown: dict[str, str]
    contested: dict[str, str]  # see :class:`.infer.Inferred`


def resolve_plan(
    model: nn.Module,
    *,
    blocks_name: str,
    blocks: nn.ModuleList,
    user_plan: dict[str, str] | None = None,
    module_plan: dict[str, str] | None = None,
    replicate: tuple[str, ...] | list[str] = (),
) -> ResolvedPlan:
    """The merged plan, the sources that gave entries (``"strategy + hugging face + inferred"``) and the
    modules inference left whole because it could not classify them (name -> why, for :mod:`.coverage`).

    ``replicate`` are module-name patterns the user keeps whole on every rank (at the user's precedence).
    HF entries in styles this package does not apply are refused unless an earlier source or inference
    plans those modules.

    Example::

        plan, source, unknown, _ = resolve_plan(module, blocks_name="model.layers", blocks=module.model.layers)
    """
    user = {**(user_plan or {}), **dict.fromkeys(replicate, "replicate")}
    hf_translated, hf_refused = hf_plan_entries(model) or ({}, {})
    sources = [
        ("strategy", user),
        ("module", module_plan or {}),
        ("attention variants", variant_plan(model, blocks_name, blocks)),
    ]
    if hf_translated:
        sources.append(("hugging face", split_gathered_fused(model, hf_translated)))
    merged, used = merge_plans(model, sources)
    inferred = infer_styles(model, blocks_name, blocks, coverer(merged))
    _refuse_hf_entries(model, merged, inferred.plan, hf_translated, hf_refused)
    plan, more = merge_plans(model, [("merged", merged), ("inferred", inferred.plan)])
    used += [s for s in more if s != "merged"]
    source = " + ".join(used) or "inferred"
    return ResolvedPlan(resolve_fused_styles(model, plan), source, inferred.unknown, inferred.contested)


def _refuse_hf_entries(model, merged, inferred, translated, refused) -> None:
    """Raise for HF entries we do not apply on modules that neither an earlier source nor inference plans."""
    planned = coverer({**merged, **inferred})
    names = [n for n, _ in model.named_modules() if n]
    left = {p: s for p, s in refused.items() if not all(planned(n) for n in names if matches(n, p))}
    if left:
        raise ValueError(hf_refusal(translated, left))


def split_gathered_fused(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """An HF plan whose known fused projections are gathered (Phi-3) with them split per head instead.

    Hugging Face gathers a fused projection's output (``colwise_gather_output``) and multiplies the
    closing layer's input columns locally (``rowwise_split_input``), so every rank computes all heads.
    Where the fused layout is known, the projection becomes a fused column split and the layers
    under the same parent that took the gathered input become ordinary row splits.
    """
    plan = dict(plan)
    names = dict(model.named_modules())
    for pattern, style in list(plan.items()):
        owner_pattern, _, leaf = pattern.rpartition(".")
        owners = [m for n, m in names.items() if matches(n, owner_pattern)]
        fused = known_fused_style(owners[0], leaf) if style == "colwise_gather" and owners else None
        if fused:
            plan[pattern] = fused
            for other, other_style in plan.items():
                if other.rpartition(".")[0] == owner_pattern and other_style == "rowwise_split_input":
                    plan[other] = "rowwise"
    return plan


def resolve_fused_styles(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with each ``fused_qkv`` entry written as ``fused_colwise:Q,K,V`` (sizes from the head counts)."""
    resolved = dict(plan)
    for pattern, style in plan.items():
        if style != "fused_qkv":
            continue
        for name, module in model.named_modules():
            if name and matches(name, pattern) and projection_dims(module) is not None:
                owner = model.get_submodule(name.rpartition(".")[0])
                resolved[pattern] = qkv_style(owner, projection_dims(module)[1], name)
                break
    return resolved


def check_style(pattern: str, style: str) -> None:
    """Refuse a style name that is not one of :data:`STYLES` (nor a ``fused_colwise``/``replicate_shared`` form)."""
    parameterized = isinstance(style, str) and ":" in style
    if kind_of(style) is None or (parameterized and style.startswith("fused_colwise:") and parse_fused(style) is None):
        raise ValueError(f"Unknown tensor-parallel style {style!r} for {pattern!r}; choose one of {STYLES}.")


def validate_plan(model: nn.Module, plan: dict[str, str], tp: int) -> dict[str, list[str]]:
    """Check styles, that every pattern matches a module and that every split dimension divides by ``tp``.

    Returns the module names each pattern matched.
    """
    names = dict(model.named_modules())
    matched: dict[str, list[str]] = {}
    for pattern, style in plan.items():
        check_style(pattern, style)
        matched[pattern] = [n for n in names if n and matches(n, pattern)]
        if not matched[pattern]:
            raise ValueError(
                f"Tensor-parallel plan pattern {pattern!r} matches no module. Module names look like "
                f"{[n for n in names if n][:6]}; fix the pattern or remove it."
            )
        for name in matched[pattern]:
            _check_divisible(name, names[name], style, tp)
    return matched


def _check_divisible(name: str, module: nn.Module, style: str, tp: int) -> None:
    if style == "experts":
        check_experts(name, module, tp)
        return
    if style == "multihead_attention":
        if not isinstance(module, nn.MultiheadAttention):
            raise ValueError(f"{name!r} is given 'multihead_attention', but it is a {type(module).__name__}.")
        check_multihead_attention(name, module, tp)
        return
    if style.startswith(FUSED_PREFIX):
        dims = projection_dims(module)
        if dims is None:
            raise ValueError(f"{name!r} is given {style!r}, but only nn.Linear and Conv1D layers can be fused-split.")
        parts = fused_sizes(style, dims[1])
        if any(p % tp for p in parts):
            raise ValueError(
                f"{name!r} ({style}) has parts {list(parts)}, not all divisible by tensor_parallel_size={tp}. Use a "
                f"tensor_parallel_size that divides every part, or keep it whole: tensor_parallel_plan={{'{name}': 'replicate', ...}}."
            )
        return
    dims = projection_dims(module)
    if dims is not None:  # nn.Linear or Conv1D (whose weight is stored transposed)
        size = {"colwise": dims[1], "colwise_gather": dims[1], "rowwise": dims[0], "rowwise_split_input": dims[0]}.get(
            style
        )
        if size is not None and size % tp:
            raise ValueError(
                f"{name!r} ({style}) has {'out' if style.startswith('col') else 'in'}_features={size}, not divisible by "
                f"tensor_parallel_size={tp}. Use a tensor_parallel_size that divides {size}, or keep it whole: "
                f"tensor_parallel_plan={{'{name}': 'replicate', ...}}."
            )
        return
    sizes = {
        "colwise": ("out_features",),
        "colwise_gather": ("out_features",),
        "rowwise": ("in_features",),
        "rowwise_split_input": ("in_features",),
        "embedding": ("num_embeddings",),
        "embedding_colwise": ("embedding_dim",),
    }.get(style, ())
    for attr in sizes:
        size = getattr(module, attr, None)
        if size is not None and size % tp:
            raise ValueError(
                f"{name!r} ({style}) has {attr}={size}, not divisible by tensor_parallel_size={tp}. Use a "
                f"tensor_parallel_size that divides {size}, or keep it whole: tensor_parallel_plan={{'{name}': 'replicate', ...}}."
            )
