"""The strategy contract for Lightning's own strategies (single device, DDP, FSDP, DeepSpeed)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Executor, Future, wait
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy

from lightning_llm.checkpointing.staging import HostCopy
from lightning_llm.checkpointing.write_gate import (
    BACKGROUND_WRITES,
    WriteGate,
    background_writer,
    resume_background_writes,
)
from lightning_llm.contract.protocol import ParallelLayout, completed, reduce_across_ranks
from lightning_llm.parallel.grad_norm import total_grad_norm

if TYPE_CHECKING:
    from lightning_llm.modeling.shape import ModelShape


class WholeModelContract:
    """Contract properties of a strategy that neither pipelines nor checkpoints activations by block.

    Shared by :class:`LightningContract` and ``LLMDeepSpeedStrategy``.
    """

    @property
    def activation_checkpointing_policies(self) -> list[str]:
        return []

    @property
    def blocks_name(self) -> str | list[str] | None:
        return None

    @property
    def tensor_parallel_coverage(self) -> list[str]:
        return []

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        return None


class LightningContract(WholeModelContract):
    """The contract for Lightning's own strategies: data parallel only, one model replica per rank.

    The gradient norm is torch's over the local gradients (after DDP's all-reduce they are the same on
    every rank). Asynchronous saving is offered where Lightning writes one file from rank 0 through
    the strategy's ``CheckpointIO`` (single device, DDP): the tensors are copied to host memory, then
    written by a background thread. Lightning's ``AsyncCheckpointIO`` does the same but exposes no
    per-save completion, which a caller committing the checkpoint needs.

    This adapter is the one place that probes Lightning's strategy classes (DeepSpeed computes the norm inside
    its step and cannot skip one; strategies overriding ``save_checkpoint``/``load_checkpoint`` bypass the
    CheckpointIO), so callbacks need not. Built from a strategy alone (``strategy=``, before a trainer), it
    answers only the checkpoint members.
    """

    def __init__(self, trainer: L.Trainer | None = None, *, strategy: Strategy | None = None) -> None:
        if (trainer is None) == (strategy is None):
            raise TypeError("LightningContract(trainer) or LightningContract(strategy=...): exactly one of them.")
        self._trainer, self._strategy = trainer, strategy

    @property
    def trainer(self) -> L.Trainer:
        if self._trainer is None:
            raise RuntimeError(
                f"This contract was made for a {type(self._strategy).__name__} alone; only the members about how it "
                "checkpoints answer without a trainer."
            )
        return self._trainer

    @property
    def strategy(self) -> Strategy:
        return self._trainer.strategy if self._trainer is not None else self._strategy

    @property
    def layout(self) -> ParallelLayout:
        trainer = self.trainer
        sharded = isinstance(trainer.strategy, (FSDPStrategy, DeepSpeedStrategy))
        return ParallelLayout(
            strategy=type(trainer.strategy).__name__,
            world_size=trainer.world_size,
            num_nodes=trainer.num_nodes,
            dp_replicate=1 if sharded else trainer.world_size,
            dp_shard=trainer.world_size if sharded else 1,
            dp_rank=trainer.global_rank,
            zero_stage=_lightning_zero_stage(trainer.strategy),
        )

    @property
    def model_shape(self) -> ModelShape | None:
        from lightning_llm.modeling.shape import ModelShape

        try:
            return ModelShape.of(self.trainer.lightning_module)
        except ValueError:  # not a decoder whose blocks can be found
            return None

    @property
    def supports_async_save(self) -> bool:
        return self.saves_through_checkpoint_io

    @property
    def saves_through_checkpoint_io(self) -> bool:
        # Lightning's base Strategy saves through checkpoint_io; FSDP, ModelParallel and DeepSpeed override it.
        return type(self.strategy).save_checkpoint is Strategy.save_checkpoint

    @property
    def loads_through_checkpoint_io(self) -> bool:
        return type(self.strategy).load_checkpoint is Strategy.load_checkpoint

    @property
    def saves_to_urls(self) -> bool:
        # Lightning's TorchCheckpointIO writes through fsspec; the strategies writing directories use local file APIs.
        return self.saves_through_checkpoint_io

    @property
    def grad_norm_ready(self) -> Literal["before_optimizer_step", "after_optimizer_step"]:
        return "after_optimizer_step" if isinstance(self.strategy, DeepSpeedStrategy) else "before_optimizer_step"

    def step_grad_norm(self) -> torch.Tensor | None:
        if not isinstance(self.strategy, DeepSpeedStrategy):
            return None
        norm = self.strategy.deepspeed_engine.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(float(norm))

    @property
    def can_skip_optimizer_step(self) -> bool:
        return not isinstance(self.strategy, DeepSpeedStrategy)

    @property
    def replica_groups(self) -> int:
        return 1  # Lightning's strategies train one job  # DeepSpeed's engine steps its own partitions

    def reduce_across_ranks(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max"] = "sum") -> torch.Tensor:
        return reduce_across_ranks(tensor, op, self.trainer.world_size)

    def grad_norm(self, parameters: Iterable[torch.Tensor] | None = None, norm_type: float = 2.0) -> torch.Tensor:
        params = self.trainer.lightning_module.parameters() if parameters is None else parameters
        if not isinstance(self.trainer.strategy, FSDPStrategy):
            # Whole gradients (averaged by DDP) or DTensor shards (FSDP2), which total_grad_norm reduces itself.
            return total_grad_norm(params, norm_type)
        # FSDP1's flat-parameter shards are plain tensors: combine every rank's part.
        local = total_grad_norm(params, norm_type)
        if norm_type == float("inf"):
            return self.trainer.strategy.reduce(local, reduce_op="max")
        return self.trainer.strategy.reduce(local.pow(norm_type), reduce_op="sum").pow(1.0 / norm_type)

    def save_checkpoint_async(self, filepath: str, weights_only: bool = False) -> Future:
        if not self.supports_async_save:
            self.trainer.save_checkpoint(filepath, weights_only=weights_only)
            return completed()
        strategy = self.trainer.strategy
        resume_background_writes()
        wait(_PENDING)  # the host buffers are reused: the previous write must have read them (errors are its caller's)
        staged = StagedWrite(strategy.checkpoint_io, background_writer(), _host_copy(), gate=BACKGROUND_WRITES)
        strategy.checkpoint_io = staged  # a public, settable attribute; restored right after this one save
        try:
            self.trainer.save_checkpoint(filepath, weights_only=weights_only)  # rank 0 hands the dict to `staged`
        finally:
            strategy.checkpoint_io = staged.inner
        _PENDING[:] = [staged.future] if staged.future else []
        return staged.future or completed()  # ranks other than 0 write nothing


_HOST_COPY: HostCopy | None = None
_PENDING: list[Future] = []


def _host_copy() -> HostCopy:
    global _HOST_COPY
    if _HOST_COPY is None:
        _HOST_COPY = HostCopy()
    return _HOST_COPY


def _lightning_zero_stage(strategy) -> int | None:
    if isinstance(strategy, DeepSpeedStrategy):
        return int(strategy.config.get("zero_optimization", {}).get("stage", 0))
    return None


class _ShortGilSlices:
    """Shorter GIL time slices while a background write runs, so the training thread gets the GIL back sooner.

    The writer (``torch.save``, pickling and buffering every byte in Python objects) holds the GIL most of
    the time; a thread asking for it waits out the interpreter's switch interval, 5 ms by default, at every
    hand-over. Measured on the 37 MB checkpoint of ``benchmarks/checkpoint_stall.py``: 3-5 ms of the
    save's stall was that wait. The previous interval is restored when the last pending write ends.
    """

    INTERVAL = 2e-4  # seconds

    def __init__(self) -> None:
        self._lock, self._users, self._saved = threading.Lock(), 0, None

    def shorten(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.INTERVAL))
            self._users += 1

    def restore(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


_GIL_SLICES = _ShortGilSlices()


def _write_then_restore(
    inner: CheckpointIO, staged: dict[str, Any], path, storage_options: Any | None, gate: WriteGate | None
) -> None:
    try:
        if gate is not None:
            gate.wait()
        inner.save_checkpoint(staged, path, storage_options=storage_options)
    finally:
        _GIL_SLICES.restore()


class StagedWrite(CheckpointIO):
    """Stands in for a strategy's CheckpointIO for one save: copies the tensors now, writes them on ``executor``.

    Lightning's ``AsyncCheckpointIO`` copies and writes in a thread too, but reports no completion of
    a particular save, and a caller committing the checkpoint must know when the file is written:
    the write's :class:`Future` is kept in ``future``.

    Arguments:
        inner: the CheckpointIO that writes (the strategy's own).
        executor: where the write runs (one worker keeps saves in order).
        host_copy: copies the tensors to host buffers (reused across saves: the caller must not stage the
            next save before this one's ``future`` is done).
        gate: if given, held at the save and the write starts once it is released (:class:`~lightning_llm.checkpointing.write_gate.WriteGate`).
    """

    def __init__(
        self, inner: CheckpointIO, executor: Executor, host_copy: HostCopy | None = None, gate: WriteGate | None = None
    ) -> None:
        self.inner, self.executor, self.host_copy, self.gate = inner, executor, host_copy or HostCopy(), gate
        self.future: Future | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        # The only stall: a point-in-time host copy, so training may change the live tensors meanwhile.
        staged = self.host_copy(checkpoint)
        _GIL_SLICES.shorten()
        if self.gate is not None:
            self.gate.hold()
        try:
            self.future = self.executor.submit(
                _write_then_restore, self.inner, staged, path, storage_options, self.gate
            )
        except BaseException:
            if self.gate is not None:
                self.gate.release()
            _GIL_SLICES.restore()
            raise

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)
