"""The :class:`~lightning_llm.contract.StrategyContract` members of ``LLMDeepSpeedStrategy`` but those of
checkpoints (:mod:`.deepspeed_checkpoint_hooks`): data parallel over every rank, sharded by ZeRO; the engine owns
the gradient partitions, so the norm is the one its step computed and a step cannot be skipped.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_llm.contract import ParallelLayout
from lightning_llm.contract.lightning import WholeModelContract
from lightning_llm.contract.protocol import reduce_across_ranks
from lightning_llm.modeling.shape import ModelShape


class DeepSpeedContractMixin(WholeModelContract):
    """The contract members of :class:`~lightning_llm.strategies.LLMDeepSpeedStrategy` (a base of it, not a
    strategy of its own), read from the strategy's ranks, ZeRO stage and engine."""

    _model_shape: ModelShape | None  # read by the strategy's setup, before DeepSpeed partitions the parameters
    world_size: int
    num_nodes: int
    global_rank: int
    zero_stage: int
    deepspeed_engine: Any

    @property
    def layout(self) -> ParallelLayout:
        """Data parallel over every rank, sharded by ZeRO."""
        return ParallelLayout(
            strategy=type(self).__name__,
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            dp_shard=self.world_size,
            dp_rank=self.global_rank,
            zero_stage=self.zero_stage,
        )

    @property
    def model_shape(self) -> ModelShape | None:
        """The model's shape, read in ``setup`` before DeepSpeed partitions the parameters."""
        return self._model_shape

    def grad_norm(self, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """The engine's global gradient norm of the last step (DeepSpeed owns the partitions: all parameters only)."""
        if parameters is not None or norm_type != 2.0:
            raise ValueError(
                "Under DeepSpeed only the engine's global 2-norm of all gradients is available "
                "(parameters=None, norm_type=2.0); the engine owns the gradient partitions."
            )
        norm = self.step_grad_norm()
        return torch.as_tensor(float("nan")) if norm is None else norm

    @property
    def grad_norm_ready(self) -> Literal["before_optimizer_step", "after_optimizer_step"]:
        """After the step: the engine computes the global norm inside its step (it owns the gradient partitions)."""
        return "after_optimizer_step"

    def step_grad_norm(self) -> torch.Tensor | None:
        """The engine's global gradient norm of its last step, before clipping (``None`` if it computed none)."""
        norm = self.deepspeed_engine.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(float(norm))

    @property
    def can_skip_optimizer_step(self) -> bool:
        """False: the engine steps the gradient partitions it holds, whatever the module's ``.grad`` say."""
        return False

    @property
    def replica_groups(self) -> int:
        """1: DeepSpeed runs have no fault-tolerant replica groups."""
        return 1

    def reduce_across_ranks(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max"] = "sum") -> torch.Tensor:
        """Reduce in place over every rank of the run and return it."""
        return reduce_across_ranks(tensor, op, self.world_size)
