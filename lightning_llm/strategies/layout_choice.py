"""``LLMParallelStrategy(layout="auto")``: the layout chosen at setup, once for the job, before the model is split.

Every rank measures the rates (a calibration's collectives need them all); rank 0 ranks the candidates
(:func:`~lightning_llm.strategies.layout_auto.rank_candidates`, each data-parallel rank keeping the dataloader's
batch) and sends its choice to the others, so all ranks build the same mesh. The choice replaces the layout options
(tensor, pipeline and context parallel sizes, sequence parallelism, ZeRO stage, activation checkpointing, pipeline
micro-batches, and for an MoE model the expert-parallel size unless one above 1 was given), which are then checked as
if the user had given them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_llm.modeling.log_redirect import redirected_log
from lightning_llm.planning.sizes import GiB
from lightning_llm.strategies.layout_auto import Candidate, rank_candidates, report_lines
from lightning_llm.strategies.layout_rates import block_unit, layout_rates, rates_source
from lightning_llm.strategies.option_combinations import check_combinations
from lightning_llm.strategies.parallel_options import StrategyOptions
from lightning_llm.strategies.zero_auto import planning_inputs


def choose_layout(trainer, module: nn.Module, options: StrategyOptions, device: torch.device, world_size: int):
    """Rank 0's :class:`~lightning_llm.strategies.layout_auto.Candidate` (every rank gets it) and the report lines;
    raises on every rank when no layout fits, naming the smallest."""
    planning = options.planning
    inputs = planning_inputs(trainer, device, planning.device_memory, planning.micro_batch_size, planning.seq_len)
    precision = str(trainer.precision)
    source = rates_source(planning.layout_rates, device)
    measured = source == "calibrate" and dist.is_initialized() and world_size > 1  # over the job's ranks
    mesh = init_device_mesh(device.type, (world_size,)) if measured else None
    rates = layout_rates(source, precision=precision, device=device, mesh=mesh, unit=block_unit(module))
    rank = dist.get_rank() if dist.is_initialized() else 0
    message: list[Any] = [None, None]
    if rank == 0:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), redirected_log(module):
            ranked = rank_candidates(
                module,
                world_size=world_size,
                seq_len=inputs["seq_len"],
                per_replica_batch=inputs["micro_batch_size"],
                accumulate=trainer.accumulate_grad_batches,
                device_memory=inputs["device_memory"],
                rates=rates,
                precision=precision,
                ep=options.parallel.expert_parallel_size if options.parallel.expert_parallel_size > 1 else None,
                context_parallel_method=options.parallel.context_parallel_method,
                documents=inputs["documents"],
            )
        fitting = [c for c in ranked if c.fits]
        message = [fitting[0] if fitting else None, report_lines(ranked, shown=5)]
    if dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(message, src=0)
    chosen, lines = message
    if chosen is None:
        memory = inputs["device_memory"] / GiB
        raise ValueError(
            f"layout='auto' found no layout of {world_size} ranks whose planned memory fits {memory:.1f} GiB per "
            f"device ({lines[-1]}). Use more devices, a smaller micro-batch or sequence, or set device_memory if the "
            "device has more."
        )
    return chosen, lines


def chosen_options(options: StrategyOptions, chosen: Candidate) -> StrategyOptions:
    """``options`` with the layout ``chosen`` put in, checked together as given options are."""
    lay = chosen.layout
    parallel = dataclasses.replace(
        options.parallel,
        tensor_parallel_size=lay.tp,
        pipeline_parallel_size=lay.pp,
        context_parallel_size=lay.cp,
        sequence_parallel=lay.sequence_parallel,
        zero_stage=lay.zero_stage,
        expert_parallel_size=lay.ep,
    )
    planning = dataclasses.replace(options.planning, activation_checkpointing=lay.activation_checkpointing, layout=None)
    pipeline = dataclasses.replace(options.pipeline, num_microbatches=lay.micro_batches if lay.pp > 1 else None)
    resolved = dataclasses.replace(options, parallel=parallel, planning=planning, pipeline=pipeline)
    check_combinations(resolved, given_ac_options=options.planning.ac_options)
    return resolved


def report(trainer, chosen: Candidate, lines: list[str]) -> None:
    """The fastest candidates, the choice and the runner-up on rank 0; the choice in every logger's hyperparameters."""
    rank_zero_info("LLMParallelStrategy: layout='auto', fastest fitting layouts first:\n" + "\n".join(lines))
    lay = chosen.layout
    chosen_values = {
        "layout/tp": lay.tp,
        "layout/pp": lay.pp,
        "layout/cp": lay.cp,
        "layout/ep": chosen.ep,
        "layout/dp": lay.dp,
        "layout/sequence_parallel": lay.sequence_parallel,
        "layout/zero_stage": lay.zero_stage,
        "layout/activation_checkpointing": lay.activation_checkpointing,
        "layout/micro_batches": lay.micro_batches,
        "layout/planned_memory_gib": chosen.memory / GiB,
        "layout/predicted_step_seconds": chosen.time.total,
    }
    for logger in trainer.loggers:
        logger.log_hyperparams(chosen_values)
        if isinstance(logger, WandbLogger):
            logger.log_text("plan/layout", columns=["line"], data=[[line] for line in lines])
