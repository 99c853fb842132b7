"""The :class:`~lightning_llm.contract.StrategyContract` side of ``LLMParallelStrategy``: what callbacks and the CLI read.

A mixin so the strategy module keeps only Lightning's lifecycle; it reads the strategy's
``parallel_dims``, ``report`` and pipelined steps, which ``setup_environment``/``setup`` fill.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Literal

import torch
from torch.optim import Optimizer

from lightning_llm._compat.lightning import saves_distributed_checkpoint
from lightning_llm.contract import ParallelLayout, completed
from lightning_llm.contract.protocol import reduce_across_ranks
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.grad_norm import clip_grad_norm_, total_grad_norm


class ParallelContract:
    """Layout, model shape, AC policies, global grad norm and async saves of an ``LLMParallelStrategy``."""

    @property
    def layout(self) -> ParallelLayout:
        """The parallel layout of this run (valid from ``setup_environment`` on)."""
        dims = self.parallel_dims
        return ParallelLayout(
            strategy=type(self).__name__,
            world_size=dims.world_size,
            num_nodes=self.num_nodes,
            tp=dims.tp,
            pp=dims.pp,
            dp_replicate=dims.dp_replicate,
            dp_shard=dims.dp_shard,
            dp_rank=dims.dp_rank(),
            zero_stage=None if self.zero_stage == "auto" else self.zero_stage,
        )

    @property
    def model_shape(self) -> ModelShape | None:
        """The whole model's shape, read before it was sharded and cut into stages."""
        return self._model_shape

    @property
    def activation_checkpointing_policies(self) -> list[str]:
        """ "none", "full" or "op" per transformer block."""
        return list(self._ac_policies)

    @property
    def blocks_name(self) -> str | None:
        """The dotted name of the transformer-block list (found, or given as ``blocks``)."""
        return self.report.blocks_name if self.report is not None else self.blocks

    @property
    def pipeline_group(self):
        """The process group of this rank's pipeline stages (``None`` without pipeline parallelism)."""
        return self.parallel_dims.mesh["pp"].get_group() if self.pipeline_parallel_size > 1 else None

    @property
    def supports_async_save(self) -> bool:
        return saves_distributed_checkpoint(self)

    @property
    def saves_through_checkpoint_io(self) -> bool:
        """False: saves go through the strategy's own ``save_checkpoint`` (DCP shards, or a full file on every rank's
        behalf after gathering), and a failed write raises on every rank."""
        return False

    @property
    def loads_through_checkpoint_io(self) -> bool:
        """False: loads go through the strategy's own ``load_checkpoint``, which verifies committed checkpoints."""
        return False

    @property
    def saves_to_urls(self) -> bool:
        """Whether checkpoints are DCP directories (torch's fsspec writer, so any URL) rather than one local file."""
        return saves_distributed_checkpoint(self)

    @property
    def grad_norm_ready(self) -> Literal["before_optimizer_step", "after_optimizer_step"]:
        """Before the step: :meth:`grad_norm` reduces the gradients the optimizer is about to use."""
        return "before_optimizer_step"

    def step_grad_norm(self) -> torch.Tensor | None:
        """None: the norm is read before the step (:meth:`grad_norm`), not computed inside it."""
        return None

    @property
    def can_skip_optimizer_step(self) -> bool:
        """True: the step is a torch optimizer's, which leaves parameters without gradients alone."""
        return True

    def reduce_across_ranks(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max"] = "sum") -> torch.Tensor:
        """Reduce in place over every rank of the run (all data, tensor and pipeline peers) and return it."""
        return reduce_across_ranks(tensor, op, self.world_size)

    def grad_norm(self, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of these parameters' gradients (default: all) across every shard and stage, as clipping sees it.

        Identical on all ranks; a weight tied across the first and last stage counts once.
        """
        skip = {id(p) for p in self._tied_copies()}
        params = self.lightning_module.parameters() if parameters is None else parameters
        return total_grad_norm([p for p in params if id(p) not in skip], norm_type, pipeline_group=self.pipeline_group)

    def save_checkpoint_async(self, filepath, weights_only: bool = False) -> Future:
        """Save the trainer's checkpoint with DCP's ``async_save``: returns once the state is copied to host memory.

        The future completes when this rank's files are written. Without sharded checkpoints
        (``save_distributed_checkpoint=False``) the save is synchronous and the future already done.
        """
        request = AsyncSave()  # reaches the strategy's save_checkpoint through Lightning's storage_options argument
        self.lightning_module.trainer.save_checkpoint(filepath, weights_only=weights_only, storage_options=request)
        return request.future

    def clip_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip this optimizer's gradients by the global norm (the strategy's precision plugin calls this)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, clip_val, pipeline_group=self.pipeline_group, counted_elsewhere=self._tied_copies())

    def _tied_copies(self) -> list:
        # A weight tied across the first and last stages enters the norm once, from the first stage.
        if self._pipelined is None or self.parallel_dims.mesh["pp"].get_local_rank() != self.report.stage_ranks[-1]:
            return []
        return [param for param, _ in self._pipelined.tied_peers]


class AsyncSave:
    """Asks ``LLMParallelStrategy.save_checkpoint`` to write in the background; it leaves the future here."""

    future: Future = completed()
