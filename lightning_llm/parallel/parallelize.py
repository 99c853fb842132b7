"""The parallelization recipe: tensor parallel, activation checkpointing, compile, then data parallel.

The order matters and is the one torchtitan uses: TP first (it replaces Linear weights by
DTensors on the ``tp`` axis), activation checkpointing next (it wraps block forwards, which TP
hooks sit inside), per-block ``torch.compile``, and FSDP2/replicate last (its per-block units
gather the TP-sharded DTensors along the ``dp`` axes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lightning_llm.parallel.blocks import find_blocks
from lightning_llm.parallel.data_parallel import apply_data_parallel, mixed_precision_policy
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.tensor_parallel import apply_tensor_parallel, resolve_plan, validate_plan


@dataclass
class ParallelizeReport:
    """What :func:`parallelize` did, for logging and for the W&B config."""

    blocks_name: str
    num_blocks: int
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_plan_source: str = ""
    zero_stage: int = 0


def data_parallel_roots(module: nn.Module, blocks_name: str) -> list[nn.Module]:
    """The modules to make FSDP/replicate roots: the top-level child holding the blocks, plus any other child with parameters.

    The LightningModule itself cannot be the root: Lightning calls ``training_step``, not
    ``forward``, so FSDP2's root forward hook (which gathers embeddings and head) would never run.
    """
    top = blocks_name.split(".")[0]
    roots = [module.get_submodule(top)] if top != blocks_name else []
    for name, child in module.named_children():
        if name != top and any(True for _ in child.parameters()):
            roots.append(child)
    if not roots:  # the blocks are a direct child of the LightningModule
        roots = [module]
    return roots


def plan_tensor_parallel(
    module: nn.Module, *, tp: int, blocks_name: str, blocks: nn.ModuleList, user_plan: dict[str, str] | None
) -> tuple[dict[str, str], str]:
    """Resolve and validate the TP plan before anything is changed, so bad input fails early."""
    hook = getattr(module, "tensor_parallel_plan", None)
    module_plan = hook() if callable(hook) else None
    plan, source = resolve_plan(module, blocks_name=blocks_name, blocks=blocks, user_plan=user_plan, module_plan=module_plan)
    validate_plan(module, plan, tp)
    return plan, source


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    *,
    zero_stage: int,
    precision: str = "32-true",
    sequence_parallel: bool = False,
    tensor_parallel_plan: dict[str, str] | None = None,
    blocks: str | None = None,
    cpu_offload: bool = False,
    compile_blocks: bool = False,
    activation_checkpointing=None,
) -> ParallelizeReport:
    """Apply TP/SP, activation checkpointing, compile and ZeRO data parallelism to ``module`` in place.

    ``activation_checkpointing`` is a callable ``(blocks) -> None`` applied between TP and FSDP,
    or ``None``.

    Example::

        dims = ParallelDims(world_size=4, tp=2)
        dims.build_mesh("cpu")
        parallelize(lightning_module, dims, zero_stage=3)
    """
    blocks_name, block_list = find_blocks(module, blocks)
    report = ParallelizeReport(blocks_name=blocks_name, num_blocks=len(block_list), zero_stage=zero_stage)
    if dims.tp > 1:
        plan, source = plan_tensor_parallel(
            module, tp=dims.tp, blocks_name=blocks_name, blocks=block_list, user_plan=tensor_parallel_plan
        )
        apply_tensor_parallel(module, plan, tp_mesh=dims.mesh["tp"], blocks=block_list, sequence_parallel=sequence_parallel)
        report.tp_plan, report.tp_plan_source = plan, source
    if activation_checkpointing is not None:
        activation_checkpointing(block_list)
    if compile_blocks:
        for block in block_list:
            block.compile()
    if dims.dp > 1 or cpu_offload or precision in ("bf16-mixed", "16-mixed"):
        dp_mesh = dims.mesh["dp"] if dims.dp_replicate == 1 or dims.dp_shard == 1 else dims.mesh["dp_replicate", "dp_shard"]
        apply_data_parallel(
            data_parallel_roots(module, blocks_name), block_list, dp_mesh=dp_mesh, zero_stage=zero_stage,
            mp_policy=mixed_precision_policy(precision), cpu_offload=cpu_offload,
        )
    return report
