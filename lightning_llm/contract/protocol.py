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
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

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
        blocks_name: the dotted name of the transformer-block list, if the strategy found or was given one; the
            blocks' dotted names when they share no container (``find_blocks`` takes either).
        tensor_parallel_coverage: per block class, the share of each part this rank holds under tensor
            parallelism (empty without it).
        pipeline_group: the process group of this rank's pipeline peers (``None`` without pipeline parallelism).
        supports_async_save: whether :meth:`save_checkpoint_async` writes in the background.
        saves_through_checkpoint_io: whether a save hands the whole checkpoint dict to ``strategy.checkpoint_io``.
        loads_through_checkpoint_io: whether a load reads the checkpoint through ``strategy.checkpoint_io``.
        saves_to_urls: whether checkpoints can be written to an fsspec URL, not only to a local path.
        grad_norm_ready: when the global gradient norm of a step can be read.
        can_skip_optimizer_step: whether dropping the gradients before the optimizer step skips it.
        replica_groups: how many fault-tolerant replica groups trained the last step together (1 without them):
            throughput counted over the whole job is this launch's times it.
    """

    @property
    def layout(self) -> ParallelLayout: ...

    @property
    def model_shape(self) -> ModelShape | None: ...

    @property
    def activation_checkpointing_policies(self) -> list[str]: ...

    @property
    def blocks_name(self) -> str | list[str] | None: ...

    @property
    def tensor_parallel_coverage(self) -> list[str]: ...

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None: ...

    @property
    def supports_async_save(self) -> bool: ...

    @property
    def saves_through_checkpoint_io(self) -> bool:
        """Whether a save hands the whole checkpoint dict to ``strategy.checkpoint_io`` (one file, written by rank 0).

        Why: a caller may wrap that CheckpointIO for one save (CheckpointRotation catches a failed write of rank 0
        there); strategies that write collectively (DCP shards, DeepSpeed) fail on every rank alike instead.
        """
        ...

    @property
    def loads_through_checkpoint_io(self) -> bool:
        """Whether a load reads the checkpoint through ``strategy.checkpoint_io`` (one file).

        Why: a caller may wrap that CheckpointIO to verify a file before it is loaded (CheckpointRotation's
        checksums); strategies loading shards verify committed checkpoints themselves.
        """
        ...

    @property
    def saves_to_urls(self) -> bool:
        """Whether checkpoints can be written to an fsspec URL (``s3://``, ``memory://``), not only to a local path.

        Why: strategies that write with local file APIs would create a directory named like the URL on the local
        disk; CheckpointRotation refuses such a ``dirpath`` before training instead.
        """
        ...

    @property
    def grad_norm_ready(self) -> Literal["before_optimizer_step", "after_optimizer_step"]:
        """When a step's global gradient norm can be read.

        ``"before_optimizer_step"``: :meth:`grad_norm` in ``on_before_optimizer_step``, with the gradients the
        optimizer is about to use (any parameters, any norm type). ``"after_optimizer_step"``: the strategy's own
        step computes it (DeepSpeed's engine, which owns the gradient partitions); read :meth:`step_grad_norm`
        once the step is taken.
        """
        ...

    def step_grad_norm(self) -> torch.Tensor | None:
        """The global 2-norm of all gradients (before clipping) that the strategy's last optimizer step computed.

        ``None`` where that step computed none, and for strategies whose norm is ready before the step
        (``grad_norm_ready == "before_optimizer_step"``: ask :meth:`grad_norm` then).
        """
        ...

    @property
    def replica_groups(self) -> int: ...

    @property
    def can_skip_optimizer_step(self) -> bool:
        """Whether ``optimizer.zero_grad(set_to_none=True)`` in ``on_before_optimizer_step`` skips the coming step.

        True where the step is a torch optimizer's (a parameter without a gradient is left alone); False where
        the strategy steps gradients it holds itself (DeepSpeed's engine), so a guard cannot skip a bad step there.
        """
        ...

    def reduce_across_ranks(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max"] = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over every rank of the run (the default process group) and return it.

        Every rank: data-parallel replicas and also tensor and pipeline peers (which may hold the same value; a
        sum counts it once per rank, a mean is unchanged by it). "mean" is the sum divided by the world size.
        Unchanged without a process group or with one rank. Call it on every rank.

        Why: a callback's decision (LossSpikeGuard's skip) must be the same on every rank, and raw collectives
        would tie callbacks to one process-group layout.
        """
        ...

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


REDUCE_OPS = ("sum", "mean", "max")


def reduce_across_ranks(tensor: torch.Tensor, op: str, world_size: int) -> torch.Tensor:
    """:meth:`StrategyContract.reduce_across_ranks` for a run of ``world_size`` ranks: one all-reduce on the
    default group where there is one and more than one rank ("mean": the sum, then divided by ``world_size``)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r}: choose one of {list(REDUCE_OPS)}.")
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            tensor /= world_size
    return tensor


def completed(value: Any = None) -> Future:
    """A future that is already done (for saves that ran before returning)."""
    future: Future = Future()
    future.set_result(value)
    return future
