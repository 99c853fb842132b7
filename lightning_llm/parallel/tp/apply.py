"""Tensor (+ sequence) parallelism for any model: apply a resolved plan with ``parallelize_module``.

Plan resolution lives in :mod:`.tp_plan` (and HF style translation in :mod:`.tp_hf_styles`),
style construction in :mod:`.tp_styles`, head counts in :mod:`.tp_heads`, and the replicated
parameters of the head-sharded region in :mod:`.tp_replicated_grads`. With sequence parallelism
the activations between blocks stay sequence-sharded DTensors, so model code that reads
``x.shape`` keeps seeing global shapes.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_llm.modeling.tied import tied_parameter_names
from lightning_llm.parallel.tp.attention_heads import shard_attention_heads
from lightning_llm.parallel.tp.attention_variants import model_config
from lightning_llm.parallel.tp.heads import check_head_counts, divide_head_counts
from lightning_llm.parallel.tp.hf_styles import HF_STYLES, hf_plan
from lightning_llm.parallel.tp.plan import (
    STYLES,
    _matches,
    add_sequence_parallel_boundaries,
    add_sequence_parallel_norms,
    infer_plan,
    resolve_plan,
    validate_plan,
)
from lightning_llm.parallel.tp.replicated_grads import (
    region_owners,
    sharded_region_modules,
    verify_on_first_forward,
)
from lightning_llm.parallel.tp.styles import parallel_style

__all__ = [
    "HF_STYLES",
    "STYLES",
    "apply_tensor_parallel",
    "check_head_counts",
    "divide_head_counts",
    "hf_plan",
    "infer_plan",
    "resolve_plan",
    "validate_plan",
    "with_region_parameters",
]

log = logging.getLogger(__name__)


def with_region_parameters(plan: dict[str, str], blocks_name: str, block: nn.Module) -> dict[str, str]:
    """``plan`` plus ``replicate_grad_sum`` for every whole-parameter module inside a head-sharded region.

    Entries the plan already has win; the first forward verifies the additions (see
    :mod:`.tp_replicated_grads`).
    """
    prefix = f"{blocks_name}.0."
    local = {}
    for name, _ in block.named_modules():
        for pattern, style in plan.items():
            if name and _matches(prefix + name, pattern):
                local[name] = style
    plan = dict(plan)
    for name in sharded_region_modules(block, local):
        plan[f"{blocks_name}.*.{name}"] = "replicate_grad_sum"
    return plan


def apply_tensor_parallel(
    model: nn.Module,
    plan: dict[str, str],
    *,
    tp_mesh: DeviceMesh,
    blocks: list[nn.Module],
    sequence_parallel: bool,
    blocks_name: str = "",
) -> None:
    """Shard ``model`` in place with ``parallelize_module`` following ``plan`` (already validated)."""
    tp = tp_mesh.size()
    if sequence_parallel:
        plan = add_sequence_parallel_norms(
            model, add_sequence_parallel_boundaries(model, plan, blocks_name), blocks_name
        )
    tied = tied_parameter_names(model)
    # Pipeline placeholders stand where another rank's modules are; they have nothing to shard.
    modules = {n: m for n, m in model.named_modules() if n and not getattr(m, "is_pipeline_placeholder", False)}
    explicit = {}
    for pattern, style in plan.items():
        for name, module in modules.items():
            if (
                _matches(name, pattern)
                and (torch_style := parallel_style(style, sequence_parallel, module)) is not None
            ):
                explicit[name] = torch_style
    parallelize_module(model, tp_mesh, explicit)
    _retie(model, tied)
    block_names = {id(m): n for n, m in model.named_modules()}
    heads, config = 0, model_config(model)
    for block in blocks:
        name = block_names[id(block)]
        local = {n: s for n, _ in block.named_modules() for p, s in plan.items() if n and _matches(f"{name}.{n}", p)}
        shard_attention_heads(block, local, tp_mesh, config)  # per-head parameters, ALiBi: before counts are divided
        heads += divide_head_counts([block], tp, region_owners(local) or None)
        verify_on_first_forward(block, local, label=name)
    log.info(
        "Applied tensor parallel (tp=%d%s) to %d modules; divided %d head counts",
        tp,
        ", sequence parallel" if sequence_parallel else "",
        len(explicit),
        heads,
    )


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
