"""Which tensor-parallel plan applies to a model: the user's, the module's, Hugging Face's, or one inferred.

A plan maps fnmatch patterns over module names (``"layers.*.attention.q_proj"``) to one of
:data:`STYLES`. The first source that has one wins, and a later source is not even looked at
(an HF plan we cannot apply never blocks a user plan):

1. the strategy's ``tensor_parallel_plan`` argument;
2. a ``tensor_parallel_plan()`` method on the LightningModule;
3. a Hugging Face ``_tp_plan`` on a submodule (its styles translated, see :mod:`.tp_hf_styles`);
4. inference from the Linear layers inside the transformer blocks (names, then shapes).
"""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from lightning_llm.parallel.tp.attention_variants import attention_plan, fill_attention_plan, model_config
from lightning_llm.parallel.tp.experts import check_experts
from lightning_llm.parallel.tp.fused import FUSED_PREFIX, fused_sizes, parse_fused, projection_dims, qkv_style
from lightning_llm.parallel.tp.hf_styles import hf_plan

STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather",
    "rowwise_split_input",
    "embedding",
    "embedding_colwise",
    "sequence_parallel",
    "replicate",
    "replicate_grad_sum",
    "fused_qkv",
    "fused_colwise:N",
    "fused_colwise:A,B,...",
    "experts",
    "gather_sequence",
    "colwise_replicated_input",
    "replicate_shared",
    "replicate_shared:N",
)
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
_FUSED = re.compile(r"^(qkv|wqkv|qkv_proj|c_attn|query_key_value|in_proj|gate_up_proj|w13|w12|kv|kv_proj)$")


def is_fused_style(style: str) -> bool:
    return style == "fused_qkv" or style.startswith(FUSED_PREFIX)


def known_fused_style(owner: nn.Module, leaf: str) -> str | None:
    """The fused style of attribute ``leaf`` of ``owner`` when its layout is known (see :data:`KNOWN_FUSED`)."""
    cls = type(owner)
    package = cls.__module__.split(".")[0]
    return KNOWN_FUSED.get((f"{package}:{cls.__name__}", leaf)) or KNOWN_FUSED.get((cls.__name__, leaf))


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def infer_plan(model: nn.Module, blocks_name: str, blocks: nn.ModuleList) -> dict[str, str]:
    """A plan from the names and shapes of the Linear layers inside the transformer blocks.

    q/k/v/gate/up-like layers are split column-wise, o/down-like ones row-wise; layers without a
    telling name are classified by shape (``dim -> wider`` is column-wise, ``wider -> dim`` row-wise).
    Fused projections and square layers without a telling name are refused: splitting them
    blindly would silently compute something else.
    """
    attention = attention_plan(blocks[0], model_config(model))  # variants first: MQA, MLA, grouped QKV
    plan = {f"{blocks_name}.*.{name}": style for name, style in attention.items()}
    for name, module in blocks[0].named_modules():
        if projection_dims(module) is None or name in attention:
            continue
        plan[f"{blocks_name}.*.{name}"] = _classify_linear(f"{blocks_name}.0.{name}", name, module, blocks[0])
    if not plan:
        raise ValueError(
            f"tensor_parallel_size > 1 but the blocks at {blocks_name!r} contain no nn.Linear (or Conv1D) layer to shard. "
            "Pass `tensor_parallel_plan` to the strategy, or use tensor_parallel_size=1."
        )
    blocks_prefix = blocks_name + "."
    for name, module in model.named_modules():
        if name.startswith(blocks_prefix):
            continue
        if isinstance(module, nn.Embedding):
            plan[name] = "embedding"
    head = _output_head(model, blocks_prefix)
    if head is not None:
        plan[head] = "colwise_gather"
    return plan


def _classify_linear(full_name: str, name: str, linear: nn.Module, block: nn.Module) -> str:
    owner_name, _, leaf = name.rpartition(".")
    known = known_fused_style(block.get_submodule(owner_name), leaf)
    if known:
        return known
    leaf = leaf.lower()
    in_features, out_features = projection_dims(linear)
    if _FUSED.match(leaf):
        raise ValueError(
            f"{full_name!r} looks like a fused projection ({in_features} -> {out_features}) of a layout this package "
            "does not know; a plain column split would give each rank a slice mixing q/k/v (or gate/up) of different "
            f"heads. Declare its layout: tensor_parallel_plan={{'{_pattern(full_name)}': STYLE, ...}} with STYLE "
            "'fused_qkv' (all q, then all k, then all v), 'fused_colwise:2' (gate then up), 'fused_colwise:Q,K,V' "
            "(explicit sizes), or 'colwise' if its rows are already contiguous per head (GPT-NeoX's q0 k0 v0 q1 k1 v1 ...)."
        )
    if _COLWISE.match(leaf):
        return "colwise"
    if _ROWWISE.match(leaf):
        return "rowwise"
    dims = [d[0] for d in map(projection_dims, block.modules()) if d is not None]
    model_dim = max(set(dims), key=dims.count)
    if in_features == model_dim and out_features != model_dim:
        return "colwise"
    if out_features == model_dim and in_features != model_dim:
        return "rowwise"
    raise ValueError(
        f"Cannot tell whether {full_name!r} ({in_features} -> {out_features}) is an input or an output "
        f"projection from its name or shape. Name it in the plan, e.g. "
        f"tensor_parallel_plan={{'{_pattern(full_name)}': 'colwise'}} (or 'rowwise'), with the other layers."
    )


def _pattern(full_name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", full_name, count=1)


def _output_head(model: nn.Module, blocks_prefix: str) -> str | None:
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = {e.num_embeddings for e in embeddings}
    heads = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not name.startswith(blocks_prefix) and m.out_features in vocab
    ]
    return heads[-1] if heads else None


def add_sequence_parallel_norms(model: nn.Module, plan: dict[str, str], blocks_name: str = "") -> dict[str, str]:
    """Mark the normalisation layers of the residual stream ``sequence_parallel`` (they see sequence-sharded activations).

    A norm beside a planned layer inside a block's submodule (OLMo2's and litgpt's ``q_norm``/``k_norm``
    next to ``q_proj`` in the attention module) runs on whole-sequence activations, so it is left to the
    plan; the block's own norms (beside its ``mlp`` or even beside its own projections) are sharded.
    """
    plan = dict(plan)
    planned = [n for n, _ in model.named_modules() if n and any(_matches(n, p) for p in plan)]
    # Parents of planned layers inside a block, the block itself excepted (its own norms see the residual stream).
    in_block = re.compile(re.escape(blocks_name) + r"\.\d+\..+")
    beside_projection = {n.rpartition(".")[0] for n in planned if in_block.fullmatch(n.rpartition(".")[0])}
    for name, module in model.named_modules():
        if getattr(module, "is_pipeline_placeholder", False):
            continue
        is_norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("Norm", "RMSNorm"))
        if is_norm and name not in planned and name.rpartition(".")[0] not in beside_projection:
            plan[name] = "sequence_parallel"
    return plan


def resolve_plan(
    model: nn.Module,
    *,
    blocks_name: str,
    blocks: nn.ModuleList,
    user_plan: dict[str, str] | None = None,
    module_plan: dict[str, str] | None = None,
) -> tuple[dict[str, str], str]:
    """The plan to apply and where it came from ("strategy", "module", "hugging face", "inferred").

    Sources are consulted lazily in order, so an HF plan with styles we refuse is never read when
    the user or the module gives a plan.
    """
    if user_plan:
        plan, source = dict(user_plan), "strategy"
    elif module_plan:
        plan, source = dict(module_plan), "module"
    elif plan := hf_plan(model):
        plan, source = (
            fill_attention_plan(model, split_gathered_fused(model, plan), blocks_name, blocks),
            "hugging face",
        )
    else:
        plan, source = infer_plan(model, blocks_name, blocks), "inferred"
    return resolve_fused_styles(model, plan), source


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
        owners = [m for n, m in names.items() if _matches(n, owner_pattern)]
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
            if name and _matches(name, pattern) and projection_dims(module) is not None:
                owner = model.get_submodule(name.rpartition(".")[0])
                resolved[pattern] = qkv_style(owner, projection_dims(module)[1], name)
                break
    return resolved


def add_sequence_parallel_boundaries(model: nn.Module, plan: dict[str, str], blocks_name: str) -> dict[str, str]:
    """Under sequence parallelism, the embeddings and output head the plan leaves out, split as :func:`infer_plan` would.

    SP needs the first block's input to be a sequence-sharded DTensor and the output head to gather
    it back; a plan without the embedding (HF GPT-NeoX) would hand the blocks a full-sequence plain
    tensor that SP reads as a local shard.
    """
    plan = dict(plan)
    prefix = blocks_name + "."

    def covered(name: str) -> bool:
        return any(_matches(name, p) for p in plan)

    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and not name.startswith(prefix) and not covered(name):
            plan[name] = "embedding"
    head = _output_head(model, prefix)
    if head is not None and not covered(head):
        plan[head] = "colwise_gather"
    # An MoE block routes whole tokens: it takes the gathered sequence and hands back its own shard.
    for pattern, style in list(plan.items()):
        parent = pattern.rpartition(".")[0]
        if style == "experts" and parent and parent not in plan:
            plan[parent] = "gather_sequence"
    return plan


def validate_plan(model: nn.Module, plan: dict[str, str], tp: int) -> dict[str, list[str]]:
    """Check styles, that every pattern matches a module and that every split dimension divides by ``tp``.

    Returns the module names each pattern matched.
    """
    names = dict(model.named_modules())
    matched: dict[str, list[str]] = {}
    for pattern, style in plan.items():
        if style not in STYLES and parse_fused(style) is None and not style.startswith("replicate_shared:"):
            raise ValueError(f"Unknown tensor-parallel style {style!r} for {pattern!r}; choose one of {STYLES}.")
        matched[pattern] = [n for n in names if n and _matches(n, pattern)]
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
