"""A model parallelized once stays parallelized: later Trainer calls on it reuse what the first one applied.

``trainer.fit(model)`` then ``trainer.test(model)`` (or ``validate`` then ``fit``, or a new Trainer on the same
model) is Lightning's most common pattern. FSDP2's ``fully_shard`` and TP's ``distribute_module`` can be applied
to a module once, and applying them again would re-split what is already split, so a second ``setup`` finds
the layout recorded for this module and restores the run state instead of parallelizing again. A different
layout on an already-parallelized model is refused, naming both: undoing a layout in place is not possible.
The record is keyed weakly by the module, so it goes when the model does; no attribute is set on the model.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm.parallel.parallelize import ParallelizeReport
from lightning_llm.strategies.parallel_options import StrategyOptions
from lightning_llm.strategies.run_state import RunState

_APPLIED: weakref.WeakKeyDictionary[nn.Module, _Applied] = weakref.WeakKeyDictionary()
_STATE = ("zero_stage", "cpu_offload", "decision", "report", "ac_policies", "model_shape", "agreed_seed", "pipeline")


@dataclass(frozen=True)
class _Applied:
    layout: tuple
    state: dict


def layout_key(options: StrategyOptions, world_size: int) -> tuple:
    """What decides how a model is split and sharded: the layout, plan and checkpointing options."""
    return world_size, options.parallel, options.pipeline, options.planning.activation_checkpointing


def record(module: nn.Module, options: StrategyOptions, state: RunState, world_size: int) -> None:
    """Remember what setup applied to ``module`` (after it was parallelized)."""
    _APPLIED[module] = _Applied(layout_key(options, world_size), {k: getattr(state, k) for k in _STATE})


def reuse(module: nn.Module, options: StrategyOptions, state: RunState, world_size: int) -> bool:
    """Restore ``state`` from an earlier setup of ``module`` with the same layout; ``False`` if there was none.

    Example::

        if not reuse(module, options, state, world_size):
            parallelize_module(trainer, module, options, state, device)
    """
    applied = _APPLIED.get(module)
    if applied is None:
        return False
    if applied.layout != layout_key(options, world_size):
        raise ValueError(
            "This model was already parallelized by an earlier Trainer call with other options "
            f"({_describe(applied.layout)}), and a layout cannot be undone in place. Use the same LLMParallelStrategy "
            f"options as that call (now: {_describe(layout_key(options, world_size))}), or build a new model "
            "(loading the trained weights from a checkpoint) for the new layout."
        )
    for name, value in applied.state.items():
        setattr(state, name, value)
    return True


def refuse_fsdp1(module: nn.Module) -> None:
    """Refuse modules wrapped with FSDP1's ``FullyShardedDataParallel``, as Lightning's ``ModelParallelStrategy``
    does: the strategy shards with FSDP2 (``fully_shard``), which cannot take over FSDP1's flat parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel`. LLMParallelStrategy "
            "(like Lightning's ModelParallelStrategy) only supports the new FSDP2 APIs in PyTorch >= 2.4: remove the "
            "FSDP1 wrapping from configure_model, or use fully_shard (or let the strategy shard the model)."
        )


def adopt_user_layout(module: nn.Module, options: StrategyOptions, state: RunState) -> bool:
    """Whether the user's ``configure_model`` already parallelized ``module`` (DTensor parameters, as Lightning's
    ``ModelParallelStrategy`` expects of it); then the strategy applies nothing more and records an empty report.

    ``tensor_parallel_size`` then only sizes the mesh's ``tensor_parallel`` axis (Lightning's meaning); pipeline
    parallelism asked of the strategy as well is refused: it would cut a model whose layers are already split.
    """
    if _APPLIED.get(module) is not None or not any(isinstance(p, DTensor) for p in module.parameters()):
        return False
    parallel = options.parallel
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(
            "configure_model already parallelized the model (its parameters are DTensors), and LLMParallelStrategy "
            f"was also asked for pipeline_parallel_size={parallel.pipeline_parallel_size}, which would cut a model "
            "whose layers are already split. Either remove the parallelize_module/fully_shard calls from "
            "configure_model and let the strategy plan every layout, or keep them and pass pipeline_parallel_size=1."
        )
    _check_data_parallel_covered(module, state)
    rank_zero_info(
        "LLMParallelStrategy: configure_model already parallelized the model (DTensor parameters); the strategy "
        "applies no sharding of its own (as Lightning's ModelParallelStrategy) and uses the layout as it is."
    )
    state.report = ParallelizeReport(blocks_name="", num_blocks=0, zero_stage=0)
    state.zero_stage, state.cpu_offload = 0, False
    return True


def _check_data_parallel_covered(module: nn.Module, state: RunState) -> None:
    """With more than one data-parallel replica, every parameter must be sharded or replicated over them (a DTensor
    on a mesh holding this rank's data-parallel peers): nothing else would reduce its gradient, and the replicas,
    each reading different batches, would silently drift apart."""
    dims = state.parallel_dims
    if dims.dp == 1:
        return
    peers = set(dims.axis("data_parallel").mesh.flatten().tolist())
    uncovered = [
        name
        for name, p in module.named_parameters()
        if not isinstance(p, DTensor) or not peers <= set(p.device_mesh.mesh.flatten().tolist())
    ]
    if uncovered:
        raise ValueError(
            f"configure_model parallelized the model by hand, but {len(uncovered)} parameters ({uncovered[:3]}) are "
            f"not sharded over the {dims.dp} data-parallel ranks (data_parallel_size={dims.dp}, "
            f"tensor_parallel_size={dims.tp}), so nothing would reduce their gradients and the replicas would drift "
            "apart. LLMParallelStrategy's default puts every device on the data-parallel axis, where Lightning's "
            "ModelParallelStrategy puts every device on the tensor-parallel axis: pass tensor_parallel_size='auto' "
            "for Lightning's layout, or also call fully_shard(..., mesh=self.device_mesh['data_parallel']) in "
            "configure_model."
        )


def _describe(layout: tuple) -> str:
    world_size, parallel, pipeline, ac = layout
    fields = {f.name: getattr(parallel, f.name) for f in dataclasses.fields(parallel)}
    shown = {k: v for k, v in fields.items() if v not in (None, False, [], 1)}
    return f"world_size={world_size}, {shown}, pipeline={pipeline.schedule}, activation_checkpointing={ac}"
