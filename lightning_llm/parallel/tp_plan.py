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

from lightning_llm.parallel.tp_hf_styles import hf_plan

STYLES = (
    "colwise", "rowwise", "colwise_gather", "rowwise_split_input", "embedding", "embedding_colwise",
    "sequence_parallel", "replicate", "replicate_grad_sum",
)

_COLWISE = re.compile(r"^(q|k|v|wq|wk|wv|query|key|value|q_proj|k_proj|v_proj|to_q|to_k|to_v|gate|up|w1|w3|gate_proj|up_proj|fc1|fc_in|c_fc|dense_h_to_4h|in_proj_q|in_proj_k|in_proj_v)$")
_ROWWISE = re.compile(r"^(o|wo|out|o_proj|out_proj|to_out|proj|down|w2|down_proj|fc2|fc_out|c_proj|dense_4h_to_h|dense)$")
_FUSED = re.compile(r"^(qkv|wqkv|qkv_proj|c_attn|query_key_value|in_proj|gate_up_proj|w13|w12|kv|kv_proj)$")


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def infer_plan(model: nn.Module, blocks_name: str, blocks: nn.ModuleList) -> dict[str, str]:
    """A plan from the names and shapes of the Linear layers inside the transformer blocks.

    q/k/v/gate/up-like layers are split column-wise, o/down-like ones row-wise; layers without a
    telling name are classified by shape (``dim -> wider`` is column-wise, ``wider -> dim`` row-wise).
    Fused projections and square layers without a telling name are refused: splitting them
    blindly would silently compute something else.
    """
    plan: dict[str, str] = {}
    for name, module in blocks[0].named_modules():
        if not isinstance(module, nn.Linear):
            continue
        plan[f"{blocks_name}.*.{name}"] = _classify_linear(f"{blocks_name}.0.{name}", name, module, blocks[0])
    if not plan:
        raise ValueError(
            f"tensor_parallel_size > 1 but the blocks at {blocks_name!r} contain no nn.Linear layer to shard. "
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


def _classify_linear(full_name: str, name: str, linear: nn.Linear, block: nn.Module) -> str:
    leaf = name.rsplit(".", 1)[-1].lower()
    if _FUSED.match(leaf):
        raise ValueError(
            f"{full_name!r} looks like a fused projection ({linear.in_features} -> {linear.out_features}); a column "
            "split would give each rank a slice mixing q/k/v (or gate/up) of different heads. Unfuse it, or, if its "
            f"rows are already grouped per rank, declare it: tensor_parallel_plan={{'{_pattern(full_name)}': 'colwise', ...}}."
        )
    if _COLWISE.match(leaf):
        return "colwise"
    if _ROWWISE.match(leaf):
        return "rowwise"
    dims = [m.in_features for m in block.modules() if isinstance(m, nn.Linear)]
    model_dim = max(set(dims), key=dims.count)
    if linear.in_features == model_dim and linear.out_features != model_dim:
        return "colwise"
    if linear.out_features == model_dim and linear.in_features != model_dim:
        return "rowwise"
    raise ValueError(
        f"Cannot tell whether {full_name!r} ({linear.in_features} -> {linear.out_features}) is an input or an output "
        f"projection from its name or shape. Name it in the plan, e.g. "
        f"tensor_parallel_plan={{'{_pattern(full_name)}': 'colwise'}} (or 'rowwise'), with the other layers."
    )


def _pattern(full_name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", full_name, count=1)


def _output_head(model: nn.Module, blocks_prefix: str) -> str | None:
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = {e.num_embeddings for e in embeddings}
    heads = [
        name for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not name.startswith(blocks_prefix) and m.out_features in vocab
    ]
    return heads[-1] if heads else None


def add_sequence_parallel_norms(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Mark every normalisation layer ``sequence_parallel`` (they see sequence-sharded activations)."""
    plan = dict(plan)
    for name, module in model.named_modules():
        if getattr(module, "is_pipeline_placeholder", False):
            continue
        is_norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("Norm", "RMSNorm"))
        if is_norm and not any(_matches(name, p) for p in plan):
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
        return dict(user_plan), "strategy"
    if module_plan:
        return dict(module_plan), "module"
    plan = hf_plan(model)
    if plan:
        return plan, "hugging face"
    return infer_plan(model, blocks_name, blocks), "inferred"


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
    return plan


def validate_plan(model: nn.Module, plan: dict[str, str], tp: int) -> dict[str, list[str]]:
    """Check styles, that every pattern matches a module and that every split dimension divides by ``tp``.

    Returns the module names each pattern matched.
    """
    names = dict(model.named_modules())
    matched: dict[str, list[str]] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
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
    sizes = {
        "colwise": ("out_features",), "colwise_gather": ("out_features",), "rowwise": ("in_features",),
        "rowwise_split_input": ("in_features",), "embedding": ("num_embeddings",), "embedding_colwise": ("embedding_dim",),
    }.get(style, ())
    for attr in sizes:
        size = getattr(module, attr, None)
        if size is not None and size % tp:
            raise ValueError(
                f"{name!r} ({style}) has {attr}={size}, not divisible by tensor_parallel_size={tp}. Use a "
                f"tensor_parallel_size that divides {size}, or keep it whole: tensor_parallel_plan={{'{name}': 'replicate', ...}}."
            )


