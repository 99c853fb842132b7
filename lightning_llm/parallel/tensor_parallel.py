"""Tensor (+ sequence) parallelism for any model, from a plan of module patterns to style names.

A plan maps fnmatch patterns over module names (``"layers.*.attention.q_proj"``) to one of
:data:`STYLES`. Where it comes from, first match wins (see :func:`resolve_plan`):

1. the strategy's ``tensor_parallel_plan`` argument;
2. a ``tensor_parallel_plan()`` method on the LightningModule;
3. a Hugging Face ``_tp_plan`` on a submodule (its style strings translated);
4. inference from the Linear layers inside the transformer blocks (names, then shapes).

The plan is turned into ``torch.distributed.tensor.parallel`` styles and applied with
``parallelize_module``. With sequence parallelism the activations between blocks stay
sequence-sharded DTensors, so model code that reads ``x.shape`` keeps seeing global shapes.
"""

from __future__ import annotations

import fnmatch
import logging
import re

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

log = logging.getLogger(__name__)

STYLES = ("colwise", "rowwise", "colwise_gather", "embedding", "sequence_parallel", "replicate")

# Hugging Face `_tp_plan` style strings we can honour, and ours they mean.
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_gather",
    "colwise_gather_output": "colwise_gather",
    "embedding_rowwise": "embedding",
    "rowwise_rep": "embedding",
    "sequence_parallel": "sequence_parallel",
}

_COLWISE = re.compile(r"^(q|k|v|wq|wk|wv|query|key|value|q_proj|k_proj|v_proj|to_q|to_k|to_v|gate|up|w1|w3|gate_proj|up_proj|fc1|fc_in|c_fc|dense_h_to_4h|in_proj_q|in_proj_k|in_proj_v)$")
_ROWWISE = re.compile(r"^(o|wo|out|o_proj|out_proj|to_out|proj|down|w2|down_proj|fc2|fc_out|c_proj|dense_4h_to_h|dense)$")
_FUSED = re.compile(r"^(qkv|wqkv|qkv_proj|c_attn|query_key_value|in_proj|gate_up_proj|w13|w12|kv|kv_proj)$")
_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """The outermost Hugging Face ``_tp_plan`` found on ``model`` or a submodule, as our style names."""
    for prefix, module in model.named_modules():
        plan = getattr(module, "_tp_plan", None)
        if isinstance(plan, dict) and plan:
            unknown = {p: s for p, s in plan.items() if s not in HF_STYLES}
            if unknown:
                raise ValueError(
                    f"The Hugging Face tensor-parallel plan on {prefix or 'the model'!r} uses styles we cannot apply: "
                    f"{unknown}. Pass `tensor_parallel_plan` to the strategy with styles from {STYLES}."
                )
            return {f"{prefix}.{p}" if prefix else p: HF_STYLES[s] for p, s in plan.items()}
    return None


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
    """The plan to apply and where it came from ("strategy", "module", "hugging face", "inferred")."""
    for source, plan in (("strategy", user_plan), ("module", module_plan), ("hugging face", hf_plan(model))):
        if plan:
            return dict(plan), source
    return infer_plan(model, blocks_name, blocks), "inferred"


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
        "embedding": ("num_embeddings",),
    }.get(style, ())
    for attr in sizes:
        size = getattr(module, attr, None)
        if size is not None and size % tp:
            raise ValueError(
                f"{name!r} ({style}) has {attr}={size}, not divisible by tensor_parallel_size={tp}. Use a "
                f"tensor_parallel_size that divides {size}, or keep it whole: tensor_parallel_plan={{'{name}': 'replicate', ...}}."
            )


def _style(style: str, sequence_parallel: bool) -> ParallelStyle | None:
    sharded_seq = Shard(1) if sequence_parallel else Replicate()
    if style == "colwise":
        return ColwiseParallel(input_layouts=sharded_seq)
    if style == "rowwise":
        return RowwiseParallel(output_layouts=sharded_seq, use_local_output=not sequence_parallel)
    if style == "colwise_gather":
        return ColwiseParallel(input_layouts=sharded_seq, output_layouts=Replicate())
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=not sequence_parallel)
    if style == "sequence_parallel":
        return SequenceParallel() if sequence_parallel else None
    return None  # "replicate"


def divide_head_counts(blocks: list[nn.Module], tp: int) -> int:
    """Divide integer head-count attributes (``num_heads``, ``n_kv_heads``, ...) of block submodules by ``tp``.

    Attention code that reshapes with a stored head count must see the local count once q/k/v
    are split column-wise. Returns how many attributes were changed.
    """
    changed = 0
    for block_idx, block in enumerate(blocks):
        for name, module in block.named_modules():
            for attr in _HEAD_ATTRS:
                value = getattr(module, attr, None)
                if not isinstance(value, int) or isinstance(value, bool):
                    continue
                if value % tp:
                    raise ValueError(
                        f"{name or 'block'}.{attr}={value} in block {block_idx} is not divisible by "
                        f"tensor_parallel_size={tp}; choose a tensor_parallel_size that divides the head counts."
                    )
                setattr(module, attr, value // tp)
                changed += 1
    return changed


def apply_tensor_parallel(
    model: nn.Module, plan: dict[str, str], *, tp_mesh: DeviceMesh, blocks: list[nn.Module], sequence_parallel: bool
) -> None:
    """Shard ``model`` in place with ``parallelize_module`` following ``plan`` (already validated)."""
    tp = tp_mesh.size()
    if sequence_parallel:
        plan = add_sequence_parallel_norms(model, plan)
    tied = _tied_parameters(model)
    styles = {p: s for p, s in ((p, _style(s, sequence_parallel)) for p, s in plan.items()) if s is not None}
    # Pipeline placeholders stand where another rank's modules are; they have nothing to shard.
    names = [n for n, m in model.named_modules() if n and not getattr(m, "is_pipeline_placeholder", False)]
    explicit = {n: style for pattern, style in styles.items() for n in names if _matches(n, pattern)}
    parallelize_module(model, tp_mesh, explicit)
    _retie(model, tied)
    heads = divide_head_counts(blocks, tp)
    log.info(
        "Applied tensor parallel (tp=%d%s) to %d modules; divided %d head counts",
        tp, ", sequence parallel" if sequence_parallel else "", len(explicit), heads,
    )


def _tied_parameters(model: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    # parallelize_module replaces each module's parameter by a new DTensor parameter, which breaks
    # weight tying (an embedding and an output head sharing one matrix). Both get Shard(0) on the
    # tp mesh, so pointing the others at the first restores the tie with consistent placements.
    for names in tied:
        first_owner, first_attr = names[0].rsplit(".", 1)
        shared = getattr(model.get_submodule(first_owner), first_attr)
        for other in names[1:]:
            owner, attr = other.rsplit(".", 1)
            current = getattr(model.get_submodule(owner), attr)
            if getattr(current, "placements", None) != getattr(shared, "placements", None):
                raise ValueError(
                    f"Tied parameters {names[0]!r} and {other!r} got different tensor-parallel placements; give "
                    "both modules the same style in tensor_parallel_plan ('embedding' and 'colwise_gather' both shard the vocabulary)."
                )
            setattr(model.get_submodule(owner), attr, shared)
