"""The stages and schedule torch's ``torch.distributed.pipelining`` runs over a gated model.

:mod:`lightning_llm.parallel.pipeline.gates` cuts the user's module into stages and gates its block list;
this module wraps each stage in the ``nn.Module`` a ``PipelineStage`` drives, builds torch's
schedule, and cuts a batch into micro-batches.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.tensor import DTensor

from lightning_llm.modeling.blocks import BlockStack, block_modules, block_names
from lightning_llm.parallel.dtensor import local_tensor
from lightning_llm.parallel.pipeline.gates import install_gates
from lightning_llm.parallel.pipeline.split import SCHEDULES, SINGLE_STAGE_SCHEDULES
from lightning_llm.parallel.pipeline.stage_state import PipelineState, StageChunk, StageOutput


class StageRunner(nn.Module):
    """The ``nn.Module`` torch's ``PipelineStage`` drives for one stage.

    Its registered children are exactly the stage's own modules (so zero-bubble schedules find the
    right weights); its forward runs the user's step function on the micro-batch whose index
    travels with the activation.
    """

    def __init__(
        self, chunk: StageChunk, state: PipelineState, owned: dict[str, nn.Module], boundary_layout=None
    ) -> None:
        super().__init__()
        self.chunk = chunk
        self.boundary_layout = boundary_layout
        self.owned = nn.ModuleDict({name.replace(".", "__"): m for name, m in owned.items()})
        self.__dict__["_state"] = state

    def forward(self, *inputs: torch.Tensor):
        first_call, self.__dict__["_metadata_known"] = not self.__dict__.get("_metadata_known"), True
        if not first_call:
            return self._forward(inputs, first_call)
        # torch's metadata inference runs this forward once (on uninitialised tensors past the first stage): what
        # the step writes into the modules' buffers (a router's route counts, running statistics) is undone, so it
        # leaves no trace. Only changed buffers are written back: torch later runs a backward through this forward,
        # which must find the buffers it saved (a causal mask) at their version.
        buffers = [(b, b.detach().clone()) for b in self.owned.buffers()]
        try:
            return self._forward(inputs, first_call)
        finally:
            with torch.no_grad():
                for buffer, before in buffers:
                    if not torch.equal(buffer, before):
                        buffer.copy_(before)

    def _forward(self, inputs: tuple, first_call: bool):
        state: PipelineState = self.__dict__["_state"]
        hidden, index = (None, inputs[0]) if self.chunk.is_first else inputs
        if first_call and self.chunk.is_last and not torch.is_grad_enabled():
            # torch infers a stage's output metadata with one extra forward before the first real micro-batch. An
            # evaluation's last stage sends a placeholder, so that forward does not run the user's step: it would
            # update the user's metrics (a torchmetrics mean in validation_step) with one micro-batch too many.
            return torch.zeros((), device=index.device)
        if self.chunk.is_first and not index.requires_grad:
            # The index travels as a differentiable leaf with a zero gradient (see the end of this method): torch
            # 2.11's split backward (zero-bubble schedules) refuses a stage output that does not require grad.
            index = index.detach().requires_grad_(True)
        if hidden is not None and self.boundary_layout is not None:
            # Sequence-parallel activations travel as their local shards and become DTensors again here.
            hidden = DTensor.from_local(hidden, *self.boundary_layout, run_check=False)
        # Shape inference runs once on uninitialised tensors (a float index may hold NaN): any valid index will do.
        first = torch.nan_to_num(index.reshape(-1)[0].detach(), nan=0.0, posinf=0.0, neginf=0.0)
        mb = int(first) % state.num_microbatches
        outputs = self._run_step(state, hidden, index, mb)
        if not first_call and mb == state.num_microbatches - 1 and state.last_backward is not None:
            _on_backward(outputs, functools.partial(state.last_backward, self.chunk))
        return outputs

    def _run_step(self, state: PipelineState, hidden, index: torch.Tensor, mb: int):
        with state.activate(self.chunk, hidden):
            try:
                out = state.step_fn(state.microbatches[mb], state.batch_idx, mb)
            except StageOutput as boundary:
                hidden = boundary.hidden
                # A new tensor, not the received buffer itself: split-backward schedules detach a stage's outputs
                # after its input gradients, which would otherwise detach this stage's input too.
                return local_tensor(hidden), index + 0
        loss = out.get("loss") if isinstance(out, dict) else out
        if loss is None:  # validation steps return nothing: send a placeholder through the schedule
            return torch.zeros((), device=index.device)
        loss = loss * state.loss_scale
        if index.requires_grad:
            # Every stage sends its received index's gradient back (torch 2.11 marks every received buffer as
            # requiring grad): the index, passed through unchanged, gets its zero gradient here. Adding 0 is exact.
            loss = loss + index.sum() * 0
        return loss


def _on_backward(outputs, callback) -> None:
    """Call ``callback`` when backward reaches ``outputs`` (the first of them that requires grad)."""
    tensors = outputs if isinstance(outputs, tuple) else (outputs,)
    tensor = next((t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if tensor is not None:
        tensor.register_hook(lambda grad: callback())


def build_stages(
    module: nn.Module,
    blocks_name: str,
    blocks: BlockStack,
    chunks: list[StageChunk],
    owned_outer: dict[str, list],
    state: PipelineState,
    *,
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup,
    boundary_layout=None,
) -> list[PipelineStage]:
    """Install the gated block list and embeddings (:func:`install_gates`), and make one ``PipelineStage`` per chunk."""
    install_gates(module, blocks_name, blocks, owned_outer, state)
    names, modules = block_names(blocks_name, blocks), block_modules(blocks)
    stages = []
    for chunk in chunks:
        # Read from the registry: the gated container answers only inside the schedule.
        owned = {names[i]: modules[i] for i in chunk.blocks}
        if chunk.is_first:
            owned.update({n: module.get_submodule(n) for n in owned_outer["before"]})
        if chunk.is_last:
            owned.update({n: module.get_submodule(n) for n in owned_outer["after"]})
        runner = StageRunner(chunk, state, owned, boundary_layout)
        stages.append(PipelineStage(runner, chunk.index, num_stages, device, group=group))
    return stages


def make_schedule(name: str, stages: list[PipelineStage], num_microbatches: int):
    """torch's schedule object; the last stage's output already is the (scaled) loss."""
    cls = SCHEDULES[name]
    stage_arg = stages[0] if name in SINGLE_STAGE_SCHEDULES else stages
    try:
        return cls(stage_arg, num_microbatches, loss_fn=_identity_loss, scale_grads=False)
    except (ValueError, AssertionError) as err:
        raise ValueError(
            f"pipeline_schedule={name!r} cannot run {num_microbatches} micro-batches over {len(stages)} stage(s) per "
            f"rank: {err}. Raise num_microbatches (a multiple of pipeline_parallel_size works for every schedule)."
        ) from err


def _identity_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output


def split_microbatches(batch: Any, num_microbatches: int) -> list:
    """The batch cut along dim 0 into equal micro-batches (tensors, dicts, tuples of them)."""
    args, _ = split_args_kwargs_into_chunks((batch,), {}, num_microbatches)
    return [a[0] for a in args]
