"""The steps of LLMParallelStrategy's ``setup_environment`` and ``setup``, as functions of its options and run state.

:func:`parallelize_module` plans (ZeRO "auto", activation checkpointing), splits, shards and materializes the
LightningModule; :func:`build_pipeline` builds this rank's pipeline runtime once the module is on its device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_llm.hf.load import load_pretrained
from lightning_llm.modeling.blocks import FoundBlocks, find_blocks
from lightning_llm.modeling.log_redirect import redirected_log
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.modeling.structure import TracedBlocks, traced_blocks
from lightning_llm.parallel.data_parallel import holds_whole_gradients
from lightning_llm.parallel.float8 import check_fp8_device
from lightning_llm.parallel.init.materialize import materialize, record_init
from lightning_llm.parallel.init.meta_writes import regrouped_modules, write_back
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.parallelize import ParallelizeReport, parallelize
from lightning_llm.parallel.pipeline.microbatches import bubble_warning, default_microbatches
from lightning_llm.parallel.pipeline.split import check_stages_fit
from lightning_llm.parallel.seeding import agree_on_seed
from lightning_llm.strategies.ac_planning import plan_checkpointing
from lightning_llm.strategies.parallel_options import StrategyOptions
from lightning_llm.strategies.pipeline_routing import check_microbatches
from lightning_llm.strategies.pipelined_steps import build_pipelined_steps
from lightning_llm.strategies.run_state import RunState
from lightning_llm.strategies.zero_auto import decide_and_report, example_batch, first_batch_shape, planning_inputs

log = logging.getLogger(__name__)


def parallel_dims(options: StrategyOptions, world_size: int) -> ParallelDims:
    """The 4-D layout (pp, dp_replicate, dp_shard, tp) of ``world_size`` ranks these options ask for."""
    parallel = options.parallel
    return ParallelDims.for_world(
        world_size,
        tp=parallel.tensor_parallel_size,
        pp=parallel.pipeline_parallel_size,
        dp=parallel.data_parallel_size,
        dp_replicate=parallel.data_parallel_replicate_size,
        replicate_all=parallel.zero_stage == 0,
        cp=parallel.context_parallel_size,
    )


def read_blocks(trainer, module, device: torch.device) -> TracedBlocks | None:
    """The blocks the model's forward runs on the first training batch (see :mod:`lightning_llm.modeling.structure`),
    or ``None`` where no batch can be read or the forward cannot run on fake tensors (the container search then
    decides, as it does for ``blocks=``-less models outside a fit)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return None
    try:
        batch = example_batch(trainer, device)
    except (ValueError, TypeError, AttributeError, IndexError) as error:
        log.debug("The blocks are found by the container search: no example batch (%s)", error)
        return None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), redirected_log(module):  # the trace draws no number of the run's
        try:
            return traced_blocks(module, lambda to_meta: module.training_step(to_meta(batch), 0))
        except Exception as error:  # the user's step on fake tensors: any failure leaves the search to decide
            log.debug("The blocks are found by the container search: the traced forward failed (%s)", error)
            return None


def parallelize_module(trainer, module, options: StrategyOptions, state: RunState, device: torch.device) -> None:
    """Read the model's structure once, plan, then split, shard and (from the meta device) materialize ``module``.

    The plan step (:func:`plan_layout`) decides the ZeRO stage, micro-batches and activation checkpointing from the
    whole model; the apply step (:func:`~lightning_llm.parallel.parallelize.parallelize`) lays it out. Both take
    the blocks found here.
    """
    on_meta = any(p.is_meta for p in module.parameters())
    if not on_meta:
        module.to(device)
    traced = read_blocks(trainer, module, device) if options.parallel.blocks is None else None
    found = find_blocks(module, options.parallel.blocks if traced is None else traced.override(module))
    checkpointing = plan_layout(trainer, module, found, options, state, device)
    init_fills = record_init(module) if on_meta else None  # the whole model's init, before it is cut up
    loaded = state.meta_writes.by_name(module) if on_meta and state.meta_writes is not None else {}
    state.meta_writes = None  # the recorded copies are host tensors as large as what was loaded: not kept past setup
    state.report = apply_layout(module, found, traced, checkpointing, options, state, str(trainer.precision), device)
    if on_meta:  # each rank allocates only its shards, filled as the unsharded model's own init would
        state.agreed_seed = agree_on_seed()  # ranks whose generators differ (not seeded alike) take rank 0's seed
        materialize(module, device, init_fills)
        if loaded:  # what configure_model loaded into the meta tensors, each rank its slice
            written = write_back(module, loaded, regrouped_modules(module, state.report.tp_plan))
            rank_zero_info(f"LLMParallelStrategy: kept {len(written)} tensors configure_model loaded")
    if options.checkpointing.load_pretrained is not None:
        load_pretrained(module, options.checkpointing.load_pretrained)  # each rank reads only the slices it holds


def plan_layout(
    trainer, module, found: FoundBlocks, options: StrategyOptions, state: RunState, device: torch.device
) -> Callable[..., None] | None:
    """The model's shape, the pipeline micro-batches, the ZeRO stage ("auto") and activation checkpointing, planned on
    the whole model before anything is cut; returns the function that checkpoints a rank's blocks (or ``None``)."""
    parallel, planning = options.parallel, options.planning
    try:  # read before the model is cut into shards and stages; MFUMonitor uses it
        state.model_shape = ModelShape.of(module, found)
    except ValueError:  # not a shape FLOP accounting understands; parallelize() says what is wrong
        state.model_shape = None
    pipelined = parallel.pipeline_parallel_size > 1
    if pipelined:
        plan_pipeline(trainer, found, options, state, device)
    if state.zero_stage == "auto":
        choose_zero_stage(trainer, module, options, state, device)
    if planning.activation_checkpointing == "none":
        state.ac_policies = ["none"] * len(found.blocks)
        return None
    state.ac_policies, checkpointing = plan_checkpointing(
        trainer,
        module,
        found.blocks,
        mode=planning.activation_checkpointing,
        options=planning.ac_options,
        tp=parallel.tensor_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        num_microbatches=state.pipeline.num_microbatches if pipelined else None,
        device=device,
    )
    return checkpointing


def plan_pipeline(trainer, found: FoundBlocks, options: StrategyOptions, state: RunState, device) -> None:
    """With pipeline parallelism: stages against the blocks, the micro-batch count, and the sequence length the
    stages' FLOPs are modelled at (attention's share; without it blocks count their matmuls)."""
    check_pipeline_stages(found, options)  # the root cause first: too few blocks, before the micro-batch count
    resolve_microbatches(trainer, options, state, device)
    check_microbatches(
        trainer,
        options.parallel.pipeline_parallel_size,
        state.pipeline.num_microbatches,
        options.pipeline.num_microbatches,
    )
    hparams = trainer.datamodule.hparams if trainer.datamodule is not None else {}
    state.pipeline.seq_len = options.planning.seq_len or hparams.get("seq_len")


def apply_layout(
    module: torch.nn.Module,
    found: FoundBlocks,
    traced: TracedBlocks | None,
    checkpointing: Callable[..., None] | None,
    options: StrategyOptions,
    state: RunState,
    precision: str,
    device: torch.device,
) -> ParallelizeReport:
    """:func:`~lightning_llm.parallel.parallelize.parallelize` with the strategy's options and the run's plan."""
    parallel = options.parallel
    return parallelize(
        module,
        state.parallel_dims,
        zero_stage=state.zero_stage,
        precision=precision,
        sequence_parallel=parallel.sequence_parallel,
        tensor_parallel_plan=parallel.tensor_parallel_plan,
        tensor_parallel_replicate=parallel.tensor_parallel_replicate,
        blocks=found,
        traced=traced,
        cpu_offload=state.cpu_offload,
        compile_blocks=parallel.compile_blocks,
        pipeline=state.pipeline if parallel.pipeline_parallel_size > 1 else None,
        activation_checkpointing=checkpointing,
        fp8=check_fp8_device(parallel.fp8, device) if parallel.fp8 else None,
        fp8_exclude=parallel.fp8_exclude,
        expert_parallel_size=parallel.expert_parallel_size,
        expert_parallel_plan=parallel.expert_parallel_plan,
        context_parallel_method=parallel.context_parallel_method,
    )


def check_pipeline_stages(found: FoundBlocks, options: StrategyOptions) -> None:
    """Refuse more pipeline stages (``pipeline_parallel_size`` x ``virtual_stages``) than the model has blocks."""
    pp = options.parallel.pipeline_parallel_size
    if pp > 1 and options.pipeline.split is None:  # an explicit split is checked where it is read
        check_stages_fit(pp * options.pipeline.spec().stages_per_rank(), len(found.blocks))


def resolve_microbatches(trainer, options: StrategyOptions, state: RunState, device: torch.device) -> None:
    """With pipeline parallelism: the default micro-batch count from the per-rank batch, and a large bubble warned."""
    pp, spec = options.parallel.pipeline_parallel_size, state.pipeline
    if pp == 1:
        return
    if spec.num_microbatches is None:
        spec.num_microbatches = default_microbatches(
            _local_batch_size(trainer, options, device), pp, spec.stages_per_rank()
        )
        rank_zero_info(
            f"LLMParallelStrategy: {spec.num_microbatches} pipeline micro-batches per step (num_microbatches)"
        )
    warning = bubble_warning(spec.schedule, pp, spec.stages_per_rank(), spec.num_microbatches)
    if warning:
        rank_zero_warn(warning)


def _local_batch_size(trainer, options: StrategyOptions, device: torch.device) -> int | None:
    """Samples per data-parallel rank and step: the strategy's micro_batch_size, the datamodule's, or a batch's."""
    hparams = trainer.datamodule.hparams if trainer.datamodule is not None else {}
    size = options.planning.micro_batch_size or hparams.get("batch_size")
    if size is None and trainer.state.fn == TrainerFn.FITTING:
        try:
            size = first_batch_shape(trainer, device)[0]
        except ValueError:  # an iterable dataset or no batch_size: the count falls back to the stages
            return None
    return size if isinstance(size, int) else None


def build_pipeline(module, options: StrategyOptions, state: RunState, device: torch.device) -> None:
    """This rank's pipeline runtime (with pipeline parallelism; a no-op without)."""
    if options.parallel.pipeline_parallel_size > 1:
        state.pipelined = build_pipelined_steps(
            module,
            state.report,
            state.parallel_dims,
            schedule=state.pipeline.schedule,
            num_microbatches=state.pipeline.num_microbatches,
            device=device,
            sequence_parallel=options.parallel.sequence_parallel,
        )


def choose_zero_stage(trainer, module, options: StrategyOptions, state: RunState, device: torch.device) -> None:
    """Plan memory for every stage and take the least-communication one that fits (before training)."""
    dims, planning = state.parallel_dims, options.planning
    state.decision = decision = decide_and_report(
        trainer,
        module,
        name="LLMParallelStrategy",
        world_size=dims.world_size,
        tp=dims.tp,
        pp=dims.pp,
        dp_replicate=dims.dp_replicate,
        cp=dims.cp,
        context_parallel_method=options.parallel.context_parallel_method,
        ep=options.parallel.expert_parallel_size,
        expert_parallel_plan=options.parallel.expert_parallel_plan,
        sequence_parallel=options.parallel.sequence_parallel,
        tensor_parallel_plan=options.parallel.tensor_parallel_plan,
        tensor_parallel_replicate=options.parallel.tensor_parallel_replicate,
        activation_checkpointing=planning.activation_checkpointing,
        ac_options=planning.ac_options,
        backend="native",
        allow_offload=True,
        whole_grads=holds_whole_gradients(
            options.parallel.accumulation_sync,
            trainer.accumulate_grad_batches,
            state.pipeline.num_microbatches if state.parallel_dims.pp > 1 else 1,
        ),
        **planning_inputs(trainer, device, planning.device_memory, planning.micro_batch_size, planning.seq_len),
    )
    state.zero_stage, state.cpu_offload = decision.stage, decision.offload != "none"


def log_layout(options: StrategyOptions, state: RunState) -> None:
    """One line on rank 0: the layout, the resolved ZeRO stage, the blocks, the TP plan's source and fp8."""
    dims, report, fp8 = state.parallel_dims, state.report, options.parallel.fp8
    rank_zero_info(
        f"LLMParallelStrategy: world={dims.world_size} pp={dims.pp} dp={dims.dp} (replicate={dims.dp_replicate}, "
        f"shard={dims.dp_shard}) cp={dims.cp} tp={dims.tp}"
        + (f" ep={options.parallel.expert_parallel_size}" if options.parallel.expert_parallel_size > 1 else "")
        + f" zero_stage={state.zero_stage}; {report.num_blocks} blocks at "
        f"{report.blocks_name!r}"
        + (f"; TP plan from {report.tp_plan_source}" if dims.tp > 1 else "")
        + (f"; fp8 ({fp8}) in {len(report.fp8_layers)} Linear layers" if fp8 else "")
    )
    if report.context_parallel:
        rank_zero_info(f"LLMParallelStrategy: {report.context_parallel}")
    for line in report.tp_coverage:
        rank_zero_info(f"LLMParallelStrategy: tensor parallel coverage: {line}")
