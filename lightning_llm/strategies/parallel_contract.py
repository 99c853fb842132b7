"""The :class:`~lightning_llm.contract.StrategyContract` answers of ``LLMParallelStrategy``, as plain functions.

Each takes the run's :class:`~.run_state.RunState` (filled by ``setup_environment``/``setup``) and whatever else it
needs explicitly; the strategy's contract members (:class:`ContractMembersMixin`) are one-line calls of these. The
checkpoint members are with the checkpoint hooks (:mod:`.checkpoint_hooks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import Literal

import torch
from torch.optim import Optimizer

from lightning_llm.contract import ParallelLayout, completed, protocol
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_llm.strategies.run_state import RunState


def layout_of(state: RunState, strategy: str, num_nodes: int) -> ParallelLayout:
    """The parallel layout of this run (valid from ``setup_environment`` on)."""
    dims = state.parallel_dims
    return ParallelLayout(
        strategy=strategy,
        world_size=dims.world_size,
        num_nodes=num_nodes,
        tp=dims.tp,
        pp=dims.pp,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        dp_rank=dims.dp_rank(),
        zero_stage=None if state.zero_stage == "auto" else state.zero_stage,
    )


def pipeline_group_of(state: RunState, pipeline_parallel_size: int):
    """The process group of this rank's pipeline stages (``None`` without pipeline parallelism)."""
    return state.parallel_dims.mesh["pp"].get_group() if pipeline_parallel_size > 1 else None


def global_grad_norm(state: RunState, parameters: Iterable[torch.Tensor], norm_type: float, group) -> torch.Tensor:
    """The norm of these parameters' gradients across every shard and stage (``group``: the pipeline's, or None).

    Identical on all ranks; a weight tied across the first and last stage counts once.
    """
    skip = {id(p) for p in tied_copies(state)}
    return total_grad_norm([p for p in parameters if id(p) not in skip], norm_type, pipeline_group=group)


def clip_to_global_norm(state: RunState, optimizer: Optimizer, clip_val: float, group) -> None:
    """Clip this optimizer's gradients by the global norm (``group``: the pipeline's, or None)."""
    params = [p for group_ in optimizer.param_groups for p in group_["params"]]
    clip_grad_norm_(params, clip_val, pipeline_group=group, counted_elsewhere=tied_copies(state))


def tied_copies(state: RunState) -> list:
    """A weight tied across the first and last stages enters the norm once, from the first stage."""
    pipelined = state.pipelined
    if pipelined is None or state.parallel_dims.mesh["pp"].get_local_rank() != state.report.stage_ranks[-1]:
        return []
    return [param for param, _ in pipelined.tied_peers]


def save_checkpoint_async(trainer, filepath, weights_only: bool) -> Future:
    """Have ``trainer`` save with DCP's ``async_save``; the future completes when this rank's files are written."""
    request = AsyncSave()  # reaches the strategy's save_checkpoint through Lightning's storage_options argument
    trainer.save_checkpoint(filepath, weights_only=weights_only, storage_options=request)
    return request.future


class AsyncSave:
    """Asks ``LLMParallelStrategy.save_checkpoint`` to write in the background; it leaves the future here."""

    future: Future = completed()


class ContractMembersMixin:
    """The :class:`~lightning_llm.StrategyContract` members of ``LLMParallelStrategy`` (documented there)
    but those of checkpoints: calls of this module's functions of ``self.run_state``."""

    run_state: RunState

    @property
    def layout(self) -> ParallelLayout:
        return layout_of(self.run_state, type(self).__name__, self.num_nodes)

    @property
    def model_shape(self) -> ModelShape | None:
        return self.run_state.model_shape

    @property
    def activation_checkpointing_policies(self) -> list[str]:
        return list(self.run_state.ac_policies)

    @property
    def blocks_name(self) -> str | list[str] | None:
        report = self.run_state.report
        if report is None:
            return self.options.parallel.blocks
        return report.blocks_name or report.block_names or None

    @property
    def tensor_parallel_coverage(self) -> list[str]:
        report = self.run_state.report
        return list(report.tp_coverage) if report is not None else []

    @property
    def pipeline_group(self):
        return pipeline_group_of(self.run_state, self.options.parallel.pipeline_parallel_size)

    # The gradient norm is read before the step; a torch optimizer's step leaves parameters without gradients alone.
    grad_norm_ready = property(lambda self: "before_optimizer_step")
    can_skip_optimizer_step = property(lambda self: True)

    @property
    def replica_groups(self) -> int:
        """The replica groups of the last step's quorum (``fault_tolerance``), else 1."""
        groups = self.run_state.replica_groups
        return max(groups.participants, 1) if groups is not None else 1

    def step_grad_norm(self) -> torch.Tensor | None:
        return None  # read before the step (grad_norm), not computed inside it

    def reduce_across_ranks(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max"] = "sum") -> torch.Tensor:
        """Reduce in place over every rank of the run (all data, tensor and pipeline peers) and return it."""
        return protocol.reduce_across_ranks(tensor, op, self.world_size)

    def grad_norm(self, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm of these parameters' gradients (default: all), as clipping sees it; equal on all ranks."""
        params = self.lightning_module.parameters() if parameters is None else parameters
        return global_grad_norm(self.run_state, params, norm_type, self.pipeline_group)

    def clip_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip this optimizer's gradients by the global norm (the strategy's precision plugin calls this)."""
        clip_to_global_norm(self.run_state, optimizer, clip_val, self.pipeline_group)
