"""The one interface between strategies and the callbacks / CLI that need to know how a run is laid out.

Callbacks ask :func:`~lightning_llm.contract.contract_of` for the trainer's :class:`StrategyContract`. Our strategies
implement it themselves; for any other Lightning strategy (single device, DDP, FSDP, Lightning's
DeepSpeed) :class:`~lightning_llm.contract.lightning.LightningContract` answers from Lightning's public attributes, so every callback
also works without our strategies: one replica per rank, no tensor or pipeline parallelism.

Example::

    contract = contract_of(trainer)
    tokens_per_step = batch_tokens * contract.layout.dp
    norm = contract.grad_norm()                      # global over every shard, stage and replica
    future = contract.save_checkpoint_async("ckpt")  # written in the background; .result() waits
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_llm.modeling.shape import ModelShape


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks of a run are laid out: degrees of each parallelism and this rank's data-parallel index.

    ``world_size == pp * dp_replicate * dp_shard * tp``; ranks with the same ``dp_rank`` read the same data.
    """

    strategy: str
    world_size: int
    num_nodes: int = 1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    dp_rank: int = 0
    zero_stage: int | None = None

    @property
    def dp(self) -> int:
        """Model replicas reading different data."""
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict[str, Any]:
        """Plain values for logs, hyperparameters and checkpoint metadata (``dp_rank`` left out: it differs per rank)."""
        values = asdict(self)
        values.pop("dp_rank")
        return {**values, "dp": self.dp}


@runtime_checkable
class StrategyContract(Protocol):
    """What a strategy tells callbacks and the CLI. Implemented by both lightning_llm strategies.

    Attributes:
        layout: the parallel layout (valid from ``setup`` on).
        model_shape: the whole model's shape for FLOP accounting, read before sharding (``None`` if unknown).
        activation_checkpointing_policies: one of "none" / "full" / "op" per transformer block.
        blocks_name: the dotted name of the transformer-block list, if the strategy found or was given one.
        pipeline_group: the process group of this rank's pipeline peers (``None`` without pipeline parallelism).
        supports_async_save: whether :meth:`save_checkpoint_async` writes in the background.
    """

    @property
    def layout(self) -> ParallelLayout: ...

    @property
    def model_shape(self) -> ModelShape | None: ...

    @property
    def activation_checkpointing_policies(self) -> list[str]: ...

    @property
    def blocks_name(self) -> str | None: ...

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None: ...

    @property
    def supports_async_save(self) -> bool: ...

    def grad_norm(self, parameters: Iterable[torch.Tensor] | None = None, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of these parameters' gradients (default: all) over every shard, stage and replica.

        Identical on every rank; a weight tied across pipeline stages counts once. Call it on every rank.
        """
        ...

    def save_checkpoint_async(self, filepath: str, weights_only: bool = False) -> Future:
        """Save the trainer's checkpoint to ``filepath``; the future completes when every file of this rank is written.

        Call it on every rank, like ``trainer.save_checkpoint``. Strategies that cannot write in the
        background save before returning a completed future (``supports_async_save`` is False).
        """
        ...


def completed(value: Any = None) -> Future:
    """A future that is already done (for saves that ran before returning)."""
    future: Future = Future()
    future.set_result(value)
    return future
