"""Gradient reduction over a pipeline schedule's micro-batches: the ones before the last reduce as Lightning's
gradient accumulation does, the last one's backward reduces.

torch's schedules defer the reduction only for a stage module that is itself an ``FSDPModule`` (and then call FSDP's
internals to reduce at the end); a stage of the user's model is not one, so without this every micro-batch reduced
every gradient (at ZeRO 0 an all-reduce per FSDP unit and micro-batch). Here each unit's reduction is switched off
for the step (:func:`~lightning_llm.parallel.data_parallel.accumulation_sync`) and back on, through FSDP2's public
calls, as backward reaches the output of the last micro-batch of the stage that holds it; with several stages on a
rank, the lowest of those holding any of the unit's parameters (backward runs a rank's stages last to first).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_llm.parallel.data_parallel import accumulation_sync, resume_gradient_sync
from lightning_llm.parallel.pipeline.stage_state import PipelineState, StageChunk


def units_by_stage(module: nn.Module, stage_params: dict[int, set[int]]) -> dict[int, list[FSDPModule]]:
    """Stage index -> the FSDP2 units of ``module`` whose reduction resumes at that stage's last micro-batch.

    ``stage_params``: this rank's stage indices -> the ids of their parameters. A unit's own parameters are those no
    unit inside it holds; a unit whose parameters no stage here holds goes with the lowest stage.
    """
    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
    lowest, grouped = min(stage_params), {}
    for unit in units:
        inner = {id(p) for child in unit.modules() if child is not unit and child in units for p in child.parameters()}
        own = {id(p) for p in unit.parameters()} - inner
        holders = [index for index, params in stage_params.items() if own & params]
        grouped.setdefault(min(holders, default=lowest), []).append(unit)
    return grouped


@contextmanager
def reduced_at_last_micro_batch(
    module: nn.Module, state: PipelineState, units: dict[int, list[FSDPModule]], every_micro_batch: bool
) -> Iterator[None]:
    """One schedule step's reduction: the micro-batches before the last as ``accumulation_sync`` does
    (``every_micro_batch``: reduce-scatter, else not at all), each stage's ``units`` resumed at its last."""

    def resume(chunk: StageChunk) -> None:
        resume_gradient_sync(units.get(chunk.index, []))

    with accumulation_sync(module, every_micro_batch=every_micro_batch):
        state.last_backward = resume
        try:
            yield
        finally:
            state.last_backward = None
