"""Tensor-parallel styles inferred from a model's structure: what no plan names gets a style here, or is reported.

Inference reads every distinct block class of the block list (hybrid models mix attention, state-space
and MoE layers), never a model's name:

* Linear (and ``Conv1D``) layers by shape (``dim -> other`` column-wise, ``other -> dim`` row-wise, ``dim``
  being the width most layers of the block read), then, where shapes cannot tell (square layers), by name
  (``q_proj`` column-wise, ``o_proj`` row-wise);
* fused projections of a known layout (:data:`KNOWN_FUSED`);
* experts modules (3-D weights indexed by expert, see :mod:`.experts`) as whole experts per rank, and the
  router beside them (a layer with one output per expert) replicated;
* the embeddings and the output head outside the blocks.

A layer it cannot classify (a fused projection of unknown layout, a square layer without a telling
name) is not split: it is returned as *unknown* with the reason and the plan entry that would split it,
and :mod:`.coverage` refuses it when it holds a real share of the block.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from lightning_llm.modeling.blocks import block_kind, block_modules, block_names, distinct_blocks
from lightning_llm.modeling.experts import expert_count, is_expert_list
from lightning_llm.parallel.tp.attention_variants import attention_plan, model_config
from lightning_llm.parallel.tp.fused import projection_dims
from lightning_llm.parallel.tp.style_kinds import matches

# Fused projections whose layout is known: [all q | all k | all v] ("fused_qkv") or two equal halves (gate | up).
# Keyed by (class of the owning module, attribute name); litgpt's class names are generic, so also by package.
KNOWN_FUSED = {
    ("GPT2Attention", "c_attn"): "fused_qkv",
    ("Phi3Attention", "qkv_proj"): "fused_qkv",
    ("Phi3MLP", "gate_up_proj"): "fused_colwise:2",
    ("litgpt:CausalSelfAttention", "qkv"): "fused_qkv",
}

_COLWISE = re.compile(
    r"^(q|k|v|wq|wk|wv|query|key|value|q_proj|k_proj|v_proj|to_q|to_k|to_v|gate|up|w1|w3|gate_proj|up_proj|fc1|fc_in|c_fc|dense_h_to_4h|in_proj_q|in_proj_k|in_proj_v)$"
)
_ROWWISE = re.compile(
    r"^(o|wo|out|o_proj|out_proj|to_out|proj|down|w2|down_proj|fc2|fc_out|c_proj|dense_4h_to_h|dense)$"
)
FUSED_NAME = re.compile(r"^(qkv|wqkv|qkv_proj|c_attn|query_key_value|in_proj|gate_up_proj|w13|w12|kv|kv_proj)$")


@dataclass
class Inferred:
    """What inference made of the modules no other source names."""

    plan: dict[str, str] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)  # module name -> why it is left whole
    # Plan pattern -> a module it names: split row-wise by shape, named like an input projection (Zamba2's q_proj
    # reads twice the block's width and writes one width of heads); :mod:`.traced_layouts` decides it.
    contested: dict[str, str] = field(default_factory=dict)


def known_fused_style(owner: nn.Module, leaf: str) -> str | None:
    """The fused style of attribute ``leaf`` of ``owner`` when its layout is known (see :data:`KNOWN_FUSED`)."""
    cls = type(owner)
    package = cls.__module__.split(".")[0]
    return KNOWN_FUSED.get((f"{package}:{cls.__name__}", leaf)) or KNOWN_FUSED.get((cls.__name__, leaf))


def pattern_of(full_name: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj`` (the block index made a wildcard)."""
    return re.sub(r"\.\d+\.", ".*.", full_name, count=1)


def infer_styles(
    model: nn.Module, blocks_name: str, blocks: nn.ModuleList, covered: Callable[[str], bool] = lambda _: False
) -> Inferred:
    """Styles for every module of ``model`` that ``covered`` says no other plan source names.

    Patterns use ``*`` for the block index where every block holding that module gets the same style,
    and explicit indices where block classes disagree.
    """
    result = Inferred()
    per_part: dict[tuple[str, str], list[str]] = {}
    owned = [
        (name, block)
        for name, block in zip(block_names(blocks_name, blocks), block_modules(blocks))
        if not getattr(block, "is_pipeline_placeholder", False)
    ]
    by_kind: dict[tuple, dict[str, tuple[str | None, str | None]]] = {}
    for block_name, block in owned:
        if block_kind(block) not in by_kind:
            by_kind[block_kind(block)] = _block_styles(block, block_name)
        for rel, (style, why) in by_kind[block_kind(block)].items():
            name = f"{block_name}.{rel}"
            if covered(name) or _under_covered(name, block_name, covered):
                continue
            if style == "replicate" and _covered_inside(block, rel, name, covered):
                continue  # a mixer whose insides another plan splits
            if style is not None:
                per_part.setdefault((rel, style), []).append(block_name)
            elif not any(n.endswith("." + rel) for n in result.unknown):
                result.unknown[name] = why
    holders = {rel: [n for n, b in owned if _has(b, rel)] for rel, _ in per_part}
    for (rel, style), members in per_part.items():
        patterns = [f"{blocks_name}.*.{rel}"] if members == holders[rel] else [f"{m}.{rel}" for m in members]
        result.plan.update(dict.fromkeys(patterns, style))
        if style == "rowwise" and _COLWISE.match(rel.rpartition(".")[2].lower()):
            result.contested.update({pattern: f"{members[0]}.{rel}" for pattern in patterns})
    result.plan.update(_outer_styles(model, blocks_name, covered))
    return result


def variant_plan(model: nn.Module, blocks_name: str, blocks) -> dict[str, str]:
    """Entries for the attention variants recognised in each block class (:mod:`.attention_variants`).

    They rank above a Hugging Face plan: a family's plan column-splits ``k_proj`` even in a config with one
    key/value head, and some plans name no attention layer at all (DeepSeek-V3's latent attention).
    """
    config, plan = model_config(model), {}
    named = list(zip(block_names(blocks_name, blocks), block_modules(blocks)))
    representatives = distinct_blocks(blocks_name, blocks)
    for _, block in representatives:
        members = [n for n, b in named if block_kind(b) == block_kind(block)]
        for name, style in attention_plan(block, config).items():
            if len(representatives) == 1:
                plan[f"{blocks_name}.*.{name}"] = style
            else:
                plan.update({f"{member}.{name}": style for member in members})
    return plan


def infer_plan(model: nn.Module, blocks_name: str, blocks: nn.ModuleList) -> dict[str, str]:
    """The inferred plan of a model no other source plans; refuses a layer it cannot classify.

    Example::

        infer_plan(model, "layers", model.layers)   # {"layers.*.attention.q_proj": "colwise", ...}
    """
    variants = variant_plan(model, blocks_name, blocks)
    inferred = infer_styles(model, blocks_name, blocks, lambda n: any(matches(n, p) for p in variants))
    inferred.plan = {**variants, **inferred.plan}
    if inferred.unknown:
        raise ValueError(next(iter(inferred.unknown.values())))
    if not any(k.startswith(blocks_name + ".") for k in inferred.plan):
        raise ValueError(
            f"tensor_parallel_size > 1 but the blocks at {blocks_name!r} contain no nn.Linear (or Conv1D) layer to shard. "
            "Pass `tensor_parallel_plan` to the strategy, or use tensor_parallel_size=1."
        )
    return inferred.plan


def _has(block: nn.Module, rel: str) -> bool:
    try:
        block.get_submodule(rel)
    except AttributeError:
        return False
    return True


def _under_covered(name: str, block_name: str, covered: Callable[[str], bool]) -> bool:
    """Whether an ancestor inside the block is named by a plan: a planned module's insides are that plan's."""
    parts = name[len(block_name) + 1 :].split(".")
    return any(covered(f"{block_name}.{'.'.join(parts[:k])}") for k in range(1, len(parts)))


def _covered_inside(block: nn.Module, rel: str, name: str, covered: Callable[[str], bool]) -> bool:
    """Whether a plan names a module inside ``name`` (a mixer another plan splits is not kept whole here)."""
    return any(covered(f"{name}.{sub}") for sub, _ in block.get_submodule(rel).named_modules() if sub)


def _block_styles(block: nn.Module, label: str) -> dict[str, tuple[str | None, str | None]]:
    """Relative module name -> (inferred style, None), or (None, why it is left whole), for one block."""
    styles: dict[str, tuple[str | None, str | None]] = {}
    experts = {n: expert_count(m) for n, m in block.named_modules() if n and expert_count(m)}
    whole = experts.keys() | convolution_mixers(block)
    for name, module in block.named_modules():
        if not name or any(name.startswith(e + ".") for e in whole):
            continue
        if name in experts:
            styles[name] = ("experts", None)
        elif name in whole:
            styles[name] = ("replicate", None)
        elif projection_dims(module) is not None:
            is_router = _is_router(name, module, block)
            styles[name] = (
                ("replicate", None) if is_router else _classify_linear(f"{label}.{name}", name, module, block)
            )
    return styles


def convolution_mixers(block: nn.Module) -> set[str]:
    """The modules of ``block`` that run a depthwise ``Conv1d`` over the sequence: state-space (Mamba),
    gated delta-net and short-convolution mixers. Their input projections are cut into parts of
    different widths and their heads are grouped in ways a column split does not follow, so they are
    kept whole on every rank (and reported as replicated) unless a plan names what is inside them. A block
    that is such a mixer itself (its own child is the convolution) gives each of its children."""
    owners = {
        name.rpartition(".")[0]
        for name, module in block.named_modules()
        if isinstance(module, nn.Conv1d) and module.groups > 1 and module.groups == module.in_channels
    }
    if "" in owners:  # the block itself: every part of it stays whole
        owners = (owners - {""}) | {name for name, _ in block.named_children()}
    return owners


def _is_router(name: str, module: nn.Module, block: nn.Module) -> bool:
    """A layer with one output per expert beside a set of experts (3-D weights or a list of expert modules),
    itself or inside a module beside them (HunYuan's ``mlp.gate.wg`` next to ``mlp.experts``): it routes
    tokens, and splitting it would give each rank the scores of some experts only."""
    parts = name.split(".")
    counts = set()
    for depth in range(len(parts)):  # the layer's own siblings, then its parent's, up to the block's children
        owner = block.get_submodule(".".join(parts[:depth])) if depth else block
        for sibling in owner.children():
            counts.add(expert_count(sibling) or (len(sibling) if is_expert_list(sibling) else None))
    return projection_dims(module)[1] in counts - {None, 1}


def _classify_linear(full_name: str, name: str, linear: nn.Module, block: nn.Module) -> tuple[str | None, str | None]:
    """(style, None), or (None, why it cannot be told) for a layer that must not be split blindly."""
    owner_name, _, leaf = name.rpartition(".")
    known = known_fused_style(block.get_submodule(owner_name), leaf)
    if known:
        return known, None
    leaf = leaf.lower()
    in_features, out_features = projection_dims(linear)
    pattern = pattern_of(full_name)
    if FUSED_NAME.match(leaf):
        return None, (
            f"{full_name!r} looks like a fused projection ({in_features} -> {out_features}) of a layout this package "
            "does not know; a plain column split would give each rank a slice mixing q/k/v (or gate/up) of different "
            f"heads. Declare its layout: tensor_parallel_plan={{'{pattern}': STYLE, ...}} with STYLE "
            "'fused_qkv' (all q, then all k, then all v), 'fused_colwise:2' (gate then up), 'fused_colwise:Q,K,V' "
            "(explicit sizes), or 'colwise' if its rows are already contiguous per head (GPT-NeoX's q0 k0 v0 q1 k1 v1 ...)."
        )
    if 1 in (in_features, out_features):  # a scalar gate (Qwen3-Next's shared_expert_gate): nothing to split
        return "replicate", None
    # Shapes first: a layer reading the residual width and writing another opens a split, one writing the
    # residual width closes it, whatever it is called (Lightning's FeedForward names its two inputs w1, w2).
    dims = [d[0] for d in map(projection_dims, block.modules()) if d is not None]
    model_dim = max(set(dims), key=dims.count)
    if in_features == model_dim and out_features != model_dim:
        return "colwise", None
    if out_features == model_dim and in_features != model_dim:
        return "rowwise", None
    if _COLWISE.match(leaf):  # names decide only what shapes cannot (square layers, latent widths)
        return "colwise", None
    if _ROWWISE.match(leaf):
        return "rowwise", None
    return None, (
        f"Cannot tell whether {full_name!r} ({in_features} -> {out_features}) is an input or an output "
        f"projection from its name or shape. Name it in the plan, e.g. "
        f"tensor_parallel_plan={{'{pattern}': 'colwise'}} (or 'rowwise'), with the other layers."
    )


def _outer_styles(model: nn.Module, blocks_name: str, covered: Callable[[str], bool]) -> dict[str, str]:
    """The embeddings (vocabulary split) and the output head (column split, gathered) outside the blocks."""
    prefix = blocks_name + "."
    plan = {
        name: "embedding"
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding) and not name.startswith(prefix) and not covered(name)
    }
    head = output_head(model, prefix)
    if head is not None and not covered(head):
        plan[head] = "colwise_gather"
    return plan


def output_head(model: nn.Module, blocks_prefix: str) -> str | None:
    """The last Linear outside the blocks whose outputs number an embedding's vocabulary, if any."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = {e.num_embeddings for e in embeddings}
    heads = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not name.startswith(blocks_prefix) and m.out_features in vocab
    ]
    return heads[-1] if heads else None
