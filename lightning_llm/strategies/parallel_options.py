"""LLMParallelStrategy's options: its keyword arguments, checked in one place and grouped by concept.

:func:`build_options` takes exactly the strategy's keyword arguments, refuses impossible ones before any process
starts (naming the value and the fix), and returns frozen :class:`StrategyOptions`. What changes during a run
(the ZeRO stage "auto" resolves to, the mesh, the pipelined steps, ...) lives in
:class:`~lightning_llm.strategies.run_state.RunState` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from lightning_llm.modeling.blocks import BlocksOverride
from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.data_parallel import ACCUMULATION_SYNC
from lightning_llm.parallel.float8 import validate_fp8
from lightning_llm.parallel.parallelize import PipelineSpec
from lightning_llm.parallel.pipeline.split import SCHEDULES
from lightning_llm.parallel.tp.float8 import FP8_TP_RECIPE, ROWWISE_REFUSAL
from lightning_llm.strategies.option_checks import (
    check_context_parallel,
    check_expert_parallel,
    check_layout,
    check_optional_str,
    check_patterns,
    check_pipeline_split,
    check_tensor_parallel_plan,
    warn_unused,
)
from lightning_llm.validation import check_bool, check_choice, check_int, check_timeout

# The collective timeout for training (see LLMParallelStrategy's `timeout` argument).
TRAINING_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class ParallelOptions:
    """The layout and how each block is parallelized (``fp8`` is the recipe name, or None when off)."""

    tensor_parallel_size: int | Literal["auto"]  # "auto" is resolved to the devices of a node at setup
    pipeline_parallel_size: int
    data_parallel_size: int | Literal["auto"]
    data_parallel_replicate_size: int
    zero_stage: Literal[0, 1, 2, 3, "auto"]  # as asked; RunState holds the stage "auto" resolves to
    sequence_parallel: bool
    tensor_parallel_plan: dict[str, str] | None
    tensor_parallel_replicate: list[str]
    blocks: BlocksOverride
    cpu_offload: bool  # as asked; RunState holds the choice of "auto"
    compile_blocks: bool
    fp8: str | None
    fp8_exclude: list[str]
    expert_parallel_size: int = 1
    expert_parallel_plan: dict[str, str] | None = None
    context_parallel_size: int = 1
    context_parallel_method: Literal["ring", "ulysses"] = "ring"
    accumulation_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto"


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline schedule; ``num_microbatches`` left ``None`` is chosen at setup from the per-rank batch size."""

    schedule: str
    num_microbatches: int | None
    virtual_stages: int | None
    split: list[list[str]] | None

    def spec(self) -> PipelineSpec:
        """A fresh :class:`PipelineSpec` for one run (setup fills its ``seq_len``)."""
        return PipelineSpec(self.schedule, self.num_microbatches, self.virtual_stages, self.split)


@dataclass(frozen=True)
class PlanningOptions:
    """Activation checkpointing and the inputs of "auto" planning (ZeRO stage, checkpointed blocks)."""

    activation_checkpointing: Literal["none", "full", "selective", "auto"]
    ac_options: ACOptions
    device_memory: int | str | None
    micro_batch_size: int | None
    seq_len: int | None


@dataclass(frozen=True)
class CheckpointingOptions:
    """Sharded (DCP) or full checkpoints, and a Hugging Face checkpoint to start from."""

    save_distributed_checkpoint: bool
    load_pretrained: str | None


@dataclass(frozen=True)
class StrategyOptions:
    """Every argument of an ``LLMParallelStrategy``, checked."""

    parallel: ParallelOptions
    pipeline: PipelineOptions
    planning: PlanningOptions
    checkpointing: CheckpointingOptions
    process_group_backend: str | None
    timeout: timedelta | None


def build_options(
    *,
    tensor_parallel_size,
    pipeline_parallel_size,
    data_parallel_size,
    data_parallel_replicate_size,
    zero_stage,
    sequence_parallel,
    tensor_parallel_plan,
    tensor_parallel_replicate,
    blocks,
    cpu_offload,
    compile_blocks,
    fp8,
    fp8_exclude,
    pipeline_schedule,
    num_microbatches,
    virtual_stages,
    pipeline_split,
    activation_checkpointing,
    activation_checkpointing_options,
    device_memory,
    micro_batch_size,
    seq_len,
    save_distributed_checkpoint,
    process_group_backend,
    timeout,
    load_pretrained,
    expert_parallel_size=1,
    expert_parallel_plan=None,
    context_parallel_size=1,
    context_parallel_method="ring",
    accumulation_sync="auto",
) -> StrategyOptions:
    """LLMParallelStrategy's keyword arguments (the same names), checked in the order its errors were always raised."""
    tp, pp, replicate = tensor_parallel_size, pipeline_parallel_size, data_parallel_replicate_size
    check_layout(
        tp,
        pp,
        data_parallel_size,
        replicate,
        zero_stage,
        sequence_parallel,
        num_microbatches,
        virtual_stages,
        device_memory,
    )
    check_context_parallel(
        context_parallel_size,
        context_parallel_method,
        compile_blocks=compile_blocks,
    )
    timeout = check_timeout("timeout", timeout)
    check_choice("accumulation_sync", accumulation_sync, ACCUMULATION_SYNC)
    for name, value in (
        ("compile_blocks", compile_blocks),
        ("cpu_offload", cpu_offload),
        ("save_distributed_checkpoint", save_distributed_checkpoint),
    ):
        check_bool(name, value)  # "no", 2 or "max-autotune" would otherwise all mean True
    check_patterns("fp8_exclude", fp8_exclude, example="['*.down_proj']")
    check_tensor_parallel_plan(tensor_parallel_plan)
    check_pipeline_split(pipeline_split)
    check_optional_str("load_pretrained", load_pretrained, "a Hugging Face checkpoint directory or a checkpoint file")
    check_optional_str("process_group_backend", process_group_backend, "a torch.distributed backend, e.g. 'nccl'")
    if pipeline_schedule not in SCHEDULES:  # at pp=1 too: a typo is a typo (validate_schedule's words)
        raise ValueError(f"pipeline_schedule={pipeline_schedule!r} is unknown; choose one of {sorted(SCHEDULES)}.")
    warn_unused(
        pp, num_microbatches, virtual_stages, pipeline_split, activation_checkpointing, activation_checkpointing_options
    )
    check_int("micro_batch_size", micro_batch_size, minimum=1, optional=True)
    check_int("seq_len", seq_len, minimum=1, optional=True)
    recipe = validate_fp8(fp8)
    replicate_patterns = check_patterns("tensor_parallel_replicate", tensor_parallel_replicate, example="['*.router']")
    if recipe is not None and recipe != FP8_TP_RECIPE and tp != 1:
        raise ValueError(
            f"fp8={fp8!r} with tensor_parallel_size={tp} is not supported: {ROWWISE_REFUSAL}. Use fp8=True "
            f"({FP8_TP_RECIPE!r}) with tensor parallelism, or fp8={fp8!r} with data and pipeline parallelism only."
        )
    check_expert_parallel(expert_parallel_size, expert_parallel_plan, data_parallel_size, context_parallel_size)
    if expert_parallel_size > 1 and activation_checkpointing in ("selective", "auto"):
        # The experts' own FSDP2 unit inside a checkpointed block runs FSDP's root pre-forward (a profiler op) only
        # in the recompute, which selective checkpointing, replaying ops by count, refuses (torch 2.13).
        raise ValueError(
            f"activation_checkpointing={activation_checkpointing!r} with expert_parallel_size={expert_parallel_size} "
            "is not supported yet (selective checkpointing cannot replay the experts' FSDP2 hooks). Use "
            "activation_checkpointing='full' or 'none'."
        )
    pipeline = PipelineOptions(pipeline_schedule, num_microbatches, virtual_stages, pipeline_split)
    if pp > 1:
        pipeline = _pipeline_microbatches(pipeline, pp, save_distributed_checkpoint)
    return StrategyOptions(
        parallel=ParallelOptions(
            tp,
            pp,
            data_parallel_size,
            replicate,
            zero_stage,
            sequence_parallel,
            tensor_parallel_plan,
            list(replicate_patterns),
            tuple(blocks) if isinstance(blocks, list) else blocks,
            cpu_offload,
            compile_blocks,
            recipe,
            list(fp8_exclude or []),
            expert_parallel_size,
            dict(expert_parallel_plan) if expert_parallel_plan else None,
            context_parallel_size,
            context_parallel_method,
            accumulation_sync,
        ),
        pipeline=pipeline,
        planning=PlanningOptions(
            activation_checkpointing,
            ACOptions.from_dict(activation_checkpointing, activation_checkpointing_options),
            device_memory,
            micro_batch_size,
            seq_len,
        ),
        checkpointing=CheckpointingOptions(save_distributed_checkpoint, load_pretrained),
        process_group_backend=process_group_backend,
        timeout=timeout,
    )


def _pipeline_microbatches(pipeline: PipelineOptions, pp: int, save_distributed_checkpoint: bool) -> PipelineOptions:
    """With pipeline parallelism: refuse full checkpoints and too few micro-batches.

    Left unset, ``num_microbatches`` is chosen at setup from the per-rank batch size
    (:func:`~lightning_llm.parallel.pipeline.microbatches.default_microbatches`).
    """
    if not save_distributed_checkpoint:
        raise ValueError(
            f"save_distributed_checkpoint=False with pipeline_parallel_size={pp}: rank 0 holds "
            "only the first stage, so a full checkpoint written by it would lack the others. Keep "
            "save_distributed_checkpoint=True (consolidate with `python -m lightning_llm.checkpoint`)."
        )
    pipeline.spec().stages_per_rank()  # refuses an unknown schedule or virtual_stages before any process starts
    if pipeline.num_microbatches is not None and pipeline.num_microbatches < pp:
        raise ValueError(
            f"num_microbatches={pipeline.num_microbatches} is fewer than pipeline_parallel_size={pp}: "
            "ranks would idle for most of every step. Use at least as many micro-batches as pipeline ranks."
        )
    return pipeline
