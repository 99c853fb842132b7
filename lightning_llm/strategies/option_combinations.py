"""The checks of LLMParallelStrategy's options that span several of them, run on the options each checked alone.

:func:`check_combinations` refuses a combination that cannot work or is not built yet (naming both values and the
way out) and warns about options the chosen mode ignores; every option's own check is in its declaration
(:mod:`~lightning_llm.strategies.parallel_options`, :mod:`~lightning_llm.strategies.option_checks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.tp.float8 import FP8_TP_RECIPE, ROWWISE_REFUSAL

if TYPE_CHECKING:
    from lightning_llm.strategies.parallel_options import StrategyOptions


def check_combinations(options: StrategyOptions, given_ac_options) -> None:
    """Every check that spans several options, in one order (``given_ac_options``: the argument as given, for the
    warning about options a mode ignores)."""
    check_layout(options)
    if options.planning.layout == "auto":
        check_auto_layout(options)
    check_expert_parallel(options)
    ACOptions.from_dict(options.planning.activation_checkpointing, options.planning.ac_options)  # "auto": a budget
    if options.parallel.pipeline_parallel_size > 1:
        check_pipeline(options)
    if options.fault_tolerance:
        check_fault_tolerance(options)
    warn_unused(options, given_ac_options)


def check_fault_tolerance(options: StrategyOptions) -> None:
    """torchft installed, and no replicate axis inside a replica group (the groups are that axis)."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ImportError(
            "fault_tolerance needs torchft: pip install 'lightning_llm[ft]' (torchft==0.2.0, with its lighthouse)."
        ) from None
    parallel = options.parallel
    if parallel.data_parallel_replicate_size > 1:
        raise ValueError(
            f"fault_tolerance=True with data_parallel_replicate_size={parallel.data_parallel_replicate_size}: the "
            "replica groups are the replicate axis (one launch each, NUM_REPLICA_GROUPS of them); keep "
            "data_parallel_replicate_size=1 inside a group."
        )


def check_auto_layout(options: StrategyOptions) -> None:
    """``layout="auto"`` chooses the parallel sizes, sequence parallelism, the pipeline's micro-batches, the ZeRO stage
    and activation checkpointing: refuse any of them given (rather than replace it silently)."""
    parallel, pipeline = options.parallel, options.pipeline
    given = {
        "tensor_parallel_size": (parallel.tensor_parallel_size, 1),
        "pipeline_parallel_size": (parallel.pipeline_parallel_size, 1),
        "context_parallel_size": (parallel.context_parallel_size, 1),
        "data_parallel_size": (parallel.data_parallel_size, "auto"),
        "data_parallel_replicate_size": (parallel.data_parallel_replicate_size, 1),
        "sequence_parallel": (parallel.sequence_parallel, False),
        "num_microbatches": (pipeline.num_microbatches, None),
        "virtual_stages": (pipeline.virtual_stages, None),
        "pipeline_split": (pipeline.split, None),
    }
    chosen = [f"{name}={value!r}" for name, (value, default) in given.items() if value != default]
    if options.parallel.zero_stage not in (3, "auto"):  # 3 is the default; "auto" asks for a choice too
        chosen.append(f"zero_stage={options.parallel.zero_stage!r}")
    if options.planning.activation_checkpointing != "none":
        chosen.append(f"activation_checkpointing={options.planning.activation_checkpointing!r}")
    if chosen:
        raise ValueError(
            f"layout='auto' chooses the layout, but {', '.join(chosen)} was given: leave it at its default, or drop "
            "layout='auto' to set the layout by hand."
        )


def check_layout(options: StrategyOptions) -> None:
    """HSDP needs sharding; sequence parallelism needs TP; CP and fp8 recipes that do not compose yet."""
    parallel = options.parallel
    tp, cp = parallel.tensor_parallel_size, parallel.context_parallel_size
    if parallel.zero_stage == 0 and parallel.data_parallel_replicate_size > 1:
        raise ValueError(
            "data_parallel_replicate_size > 1 (HSDP) needs zero_stage 2 or 3; zero_stage=0 already replicates everywhere."
        )
    if parallel.sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tensor_parallel_size > 1 (it shards along the TP group).")
    if cp > 1 and parallel.compile_blocks:
        raise ValueError(
            f"context_parallel_size={cp} with compile_blocks=True is not supported yet (the attention "
            "redirection, block hooks and a function mode, is untested inside compiled blocks). Use "
            "compile_blocks=False with context parallelism."
        )
    if parallel.fp8 is not None and parallel.fp8 != FP8_TP_RECIPE and tp != 1:
        raise ValueError(
            f"fp8={parallel.fp8!r} with tensor_parallel_size={tp} is not supported: {ROWWISE_REFUSAL}. Use fp8=True "
            f"({FP8_TP_RECIPE!r}) with tensor parallelism, or fp8={parallel.fp8!r} with data and pipeline "
            "parallelism only."
        )


def check_expert_parallel(options: StrategyOptions) -> None:
    """An expert-parallel size that cannot work with the others (the experts' count is checked on the model)."""
    parallel, mode = options.parallel, options.planning.activation_checkpointing
    ep, dp, cp = parallel.expert_parallel_size, parallel.data_parallel_size, parallel.context_parallel_size
    if ep > 1 and cp != 1:
        raise ValueError(
            f"expert_parallel_size={ep} with context_parallel_size={cp} is not supported yet: the experts' groups "
            "are carved from the data-parallel ranks, which context parallelism also divides. Use one of the two."
        )
    if ep > 1 and dp != "auto" and dp % ep:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide data_parallel_size={dp}: the expert-parallel groups are "
            f"carved out of the data-parallel ranks. Use an expert_parallel_size that divides {dp}."
        )
    if ep > 1 and mode in ("selective", "auto"):
        # The experts' own FSDP2 unit inside a checkpointed block runs FSDP's root pre-forward (a profiler op) only
        # in the recompute, which selective checkpointing, replaying ops by count, refuses (torch 2.13).
        raise ValueError(
            f"activation_checkpointing={mode!r} with expert_parallel_size={ep} is not supported yet (selective "
            "checkpointing cannot replay the experts' FSDP2 hooks). Use activation_checkpointing='full' or 'none'."
        )


def check_pipeline(options: StrategyOptions) -> None:
    """With pipeline parallelism: refuse full checkpoints, a schedule's impossible stages and too few micro-batches.

    Left unset, ``num_microbatches`` is chosen at setup from the per-rank batch size
    (:func:`~lightning_llm.parallel.pipeline.microbatches.default_microbatches`).
    """
    pp, pipeline = options.parallel.pipeline_parallel_size, options.pipeline
    if not options.checkpointing.save_distributed_checkpoint:
        raise ValueError(
            f"save_distributed_checkpoint=False with pipeline_parallel_size={pp}: rank 0 holds "
            "only the first stage, so a full checkpoint written by it would lack the others. Keep "
            "save_distributed_checkpoint=True (consolidate with `python -m lightning_llm.checkpoint`)."
        )
    pipeline.spec().stages_per_rank()  # refuses virtual_stages the schedule cannot take, before any process starts
    if pipeline.num_microbatches is not None and pipeline.num_microbatches < pp:
        raise ValueError(
            f"num_microbatches={pipeline.num_microbatches} is fewer than pipeline_parallel_size={pp}: "
            "ranks would idle for most of every step. Use at least as many micro-batches as pipeline ranks."
        )


def warn_unused(options: StrategyOptions, given_ac_options) -> None:
    """Options that the chosen mode ignores, said once instead of dropped silently."""
    pipeline, mode = options.pipeline, options.planning.activation_checkpointing
    ignored = [
        f"{name}={value!r}"
        for name, value in (
            ("num_microbatches", pipeline.num_microbatches),
            ("virtual_stages", pipeline.virtual_stages),
            ("pipeline_split", pipeline.split),
        )
        if value is not None
    ]
    if options.parallel.pipeline_parallel_size == 1 and ignored:
        rank_zero_warn(f"{', '.join(ignored)} ignored: pipeline_parallel_size=1 runs no pipeline.")
    if isinstance(given_ac_options, ACOptions):  # the CLI parses a config's options into the dataclass
        defaults = ACOptions()
        given = {k: v for k, v in vars(given_ac_options).items() if v != getattr(defaults, k)}
    else:
        given = dict(given_ac_options or {})
    if mode in ("none", "full") and given:
        rank_zero_warn(
            f"activation_checkpointing_options={given!r} ignored: activation_checkpointing={mode!r} takes none of "
            "them (they apply to 'selective' and 'auto')."
        )
    sync_every = options.fault_tolerance_sync_every
    if options.fault_tolerance not in ("local_sgd", "diloco") and sync_every != 100:
        rank_zero_warn(
            f"fault_tolerance_sync_every={sync_every} ignored: fault_tolerance={options.fault_tolerance!r} "
            'synchronizes every step (or not at all); it applies to "local_sgd" and "diloco".'
        )
