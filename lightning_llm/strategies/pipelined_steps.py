"""Running Lightning's training/validation steps through a pipeline schedule.

One Lightning step becomes one ``schedule.step`` (forward and backward of every micro-batch) or
``schedule.eval`` (forward only). The user's ``self.log`` calls happen on the last stage, once per
micro-batch; they are recorded, averaged over micro-batches and replayed on every pipeline rank,
so every rank logs the same keys and ``sync_dist`` reductions line up.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.tensor import Shard

from lightning_llm.modeling.log_redirect import redirected_log
from lightning_llm.parallel.dtensor import local_tensor
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.parallelize import ParallelizeReport
from lightning_llm.parallel.pipeline.deferred_reduction import reduced_at_last_micro_batch, units_by_stage
from lightning_llm.parallel.pipeline.gates import PipelineState
from lightning_llm.parallel.pipeline.stages import build_stages, make_schedule, split_microbatches


class PipelinedSteps:
    """The pipeline side of LLMParallelStrategy for one rank."""

    def __init__(
        self,
        state: PipelineState,
        schedule,
        stage_ranks: list[int],
        pp_group: dist.ProcessGroup,
        tied_peers: list[tuple[torch.nn.Parameter, int]],
        stage_params: dict[int, set[int]],
    ) -> None:
        self.state = state
        self.stage_params = stage_params  # this rank's stage indices -> ids of their parameters
        self._units: dict | None = None
        self.schedule = schedule
        self.pp_group = pp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.last_stage_rank = dist.get_global_rank(pp_group, stage_ranks[-1])
        self.has_first = any(c.is_first for c in state.chunks)
        self.has_last = any(c.is_last for c in state.chunks)
        self.tied_peers = tied_peers
        self._fresh: list = []

    def check_batch(self, batch: Any) -> None:
        try:
            size = extract_batch_size(batch)  # Lightning's walker: the first tensor's dim 0 in any collection
        except MisconfigurationException as err:
            raise TypeError(
                f"Cannot find the batch size of a {type(batch).__name__} batch for pipeline micro-batching."
            ) from err
        if size % self.state.num_microbatches:
            raise ValueError(
                f"The batch size per data-parallel rank is {size}, not divisible by num_microbatches="
                f"{self.state.num_microbatches}; change the batch size or num_microbatches."
            )

    def _run(self, module, step_fn, batch, batch_idx: int, loss_scale: float, train: bool, every_micro_batch=None):
        self.check_batch(batch)
        state = self.state
        state.microbatches = split_microbatches(batch, state.num_microbatches)
        state.batch_idx, state.loss_scale, state.logs = batch_idx, loss_scale, {}
        state.step_fn = lambda mb, idx, mb_index: self._call_recording_logs(module, step_fn, mb, idx, mb_index)
        # The micro-batch index travels with the activations. Floating point: torch 2.11's stages mark every received
        # buffer as requiring grad, which integer tensors cannot.
        index = torch.arange(state.num_microbatches, device=_device(module), dtype=torch.float32)
        args = (index,) if self.has_first else ()
        kwargs = {"target": index} if self.has_last else {}
        losses: list[torch.Tensor] = []
        if train:
            earlier = self._take_gradients(module)
            with self._reduced_at_last_micro_batch(module, every_micro_batch):
                self.schedule.step(*args, losses=losses if self.has_last else None, return_outputs=False, **kwargs)
            self._sync_tied_gradients()
            self._fresh = self._take_gradients(module)
            self._put_gradients(module, earlier)
        else:
            self.schedule.eval(*args, return_outputs=False, **kwargs)
        return self._publish(module, losses, loss_scale)

    @contextmanager
    def _reduced_at_last_micro_batch(self, module, every_micro_batch: bool | None):
        """The schedule's micro-batches before the last reduce as Lightning's accumulation does, the last one's
        backward reduces (:mod:`lightning_llm.parallel.pipeline.deferred_reduction`). ``None``: Lightning is
        accumulating, its context holds."""
        if every_micro_batch is None or self.state.num_microbatches == 1:
            yield
            return
        if self._units is None:  # FSDP2 has wrapped the model by the first step
            self._units = units_by_stage(module, self.stage_params)
        with reduced_at_last_micro_batch(module, self.state, self._units, every_micro_batch):
            yield

    # Lightning zeroes gradients *between* training_step and backward (the closure runs the step,
    # then zero_grad, then backward). The schedule computes gradients inside training_step, so they
    # are held aside here and added back in backward(), exactly where Lightning expects them.
    @staticmethod
    def _take_gradients(module) -> list:
        grads = [p.grad for p in module.parameters()]
        for p in module.parameters():
            p.grad = None
        return grads

    @staticmethod
    def _put_gradients(module, grads: list) -> None:
        for p, g in zip(module.parameters(), grads):
            p.grad = g

    def add_step_gradients(self, module) -> None:
        """Called from the strategy's backward(): add this step's gradients to what Lightning left."""
        for p, fresh in zip(module.parameters(), self._fresh):
            if fresh is None:
                continue
            p.grad = fresh if p.grad is None else p.grad.add_(fresh)
        self._fresh = []

    def training_step(
        self,
        module,
        batch,
        batch_idx: int,
        accumulate: int,
        grad_scaler: torch.amp.GradScaler | None = None,
        every_micro_batch: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        """One optimizer step's micro-batches through the schedule; returns the loss as one process reports it.
        ``every_micro_batch``: how the micro-batches before the last reduce (see :meth:`_reduced_at_last_micro_batch`).

        Backward runs inside the schedule, where Lightning cannot scale the loss: with fp16's ``grad_scaler`` the
        loss is multiplied by its scale here (a power of two, so exactly what ``GradScaler.scale`` does), and
        Lightning's ``unscale_`` before the optimizer step divides it out again.
        """
        scale = 1.0 / (self.state.num_microbatches * accumulate)
        if grad_scaler is not None and grad_scaler.is_enabled():
            scale *= grad_scaler.get_scale()
        loss = self._run(module, module.training_step, batch, batch_idx, scale, True, every_micro_batch)
        return {"loss": loss}

    def evaluation_step(self, module, step_fn, batch, batch_idx: int) -> None:
        self._run(module, step_fn, batch, batch_idx, 1.0, train=False)

    def _call_recording_logs(self, module, step_fn, mb, batch_idx: int, mb_index: int):
        def record(name, value, *args, **kwargs):
            value = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            self.state.logs.setdefault(mb_index, {})[name] = (value, kwargs)

        with redirected_log(module, record):
            return step_fn(mb, batch_idx)

    def _publish(self, module, losses: list[torch.Tensor], loss_scale: float) -> torch.Tensor:
        payload = [None]
        if self.has_last:
            names = {n for logs in self.state.logs.values() for n in logs}
            payload[0] = {
                "logs": {
                    n: (
                        _mean([logs[n][0] for logs in self.state.logs.values() if n in logs]),
                        next(logs[n][1] for logs in self.state.logs.values() if n in logs),
                    )
                    for n in names
                },
                "loss": _mean([loss.detach() / loss_scale for loss in losses]) if losses else None,
            }
        # One small object broadcast a step: the last stage's metrics reach every pipeline rank.
        dist.broadcast_object_list(payload, src=self.last_stage_rank, group=self.pp_group)
        device = _device(module)
        for name, (value, kwargs) in payload[0]["logs"].items():
            module.log(name, torch.tensor(value, device=device), **kwargs)
        loss = payload[0]["loss"]
        return torch.tensor(loss, device=device) if loss is not None else None

    def _sync_tied_gradients(self) -> None:
        # A weight shared by the first and last stages (tied embeddings) is a separate copy on each
        # stage's rank; each copy got the gradient of its own use, so the two ranks exchange and add.
        for param, peer in self.tied_peers:
            grad = local_tensor(param.grad)
            incoming = torch.empty_like(grad)
            peer_global = dist.get_global_rank(self.pp_group, peer)
            ops = [
                dist.P2POp(dist.isend, grad.contiguous(), peer_global, self.pp_group),
                dist.P2POp(dist.irecv, incoming, peer_global, self.pp_group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            grad.add_(incoming)


def _mean(values: list[torch.Tensor]) -> float:
    return float(torch.stack([v.float().cpu() for v in values]).mean())


def _device(module) -> torch.device:
    return module.device


def build_pipelined_steps(
    module: torch.nn.Module,
    report: ParallelizeReport,
    dims: ParallelDims,
    *,
    schedule: str,
    num_microbatches: int,
    device: torch.device,
    sequence_parallel: bool,
) -> PipelinedSteps:
    """This rank's stages of the already stage-split ``module``, their schedule, and the tied-weight peers."""
    state = PipelineState(chunks=report.chunks, num_microbatches=num_microbatches)
    pp_group = dims.mesh["pp"].get_group()
    stages = build_stages(
        module,
        report.blocks_name,
        module.get_submodule(report.blocks_name),
        report.chunks,
        report.outer,
        state,
        num_stages=len(report.stage_ranks),
        device=device,
        group=pp_group,
        boundary_layout=(dims.mesh["tp"], (Shard(1),)) if sequence_parallel else None,
    )
    steps = make_schedule(schedule, stages, num_microbatches)
    stage_params = {stage.stage_index: {id(p) for p in stage.submod.parameters()} for stage in stages}
    return PipelinedSteps(state, steps, report.stage_ranks, pp_group, _tied_peers(module, report, dims), stage_params)


def _tied_peers(module: torch.nn.Module, report: ParallelizeReport, dims: ParallelDims) -> list:
    """Parameters shared by the first and last stages, with the pipeline rank holding the other copy."""
    first, last = report.stage_ranks[0], report.stage_ranks[-1]
    me = dims.mesh["pp"].get_local_rank()
    if first == last or me not in (first, last):
        return []
    present = dict(module.named_parameters(remove_duplicate=False))
    peers = []
    for names in report.tied:
        mine = [present[n] for n in names if n in present]
        if mine:
            peers.append((mine[0], last if me == first else first))
    return peers
