"""LLMParallelStrategy: ZeRO 0-3 data parallelism, tensor/sequence and pipeline parallelism for any LightningModule LLM.

The strategy translates Lightning's lifecycle into calls of plain functions: the layout
(:mod:`lightning_llm.parallel.mesh`), the parallelization itself (:mod:`lightning_llm.parallel.parallelize`),
activation-checkpointing and ZeRO "auto" planning (:mod:`.ac_planning`, :mod:`.zero_auto`), sharded
checkpoints (:mod:`.dcp_checkpoint`) and pipeline steps (:mod:`.pipelined_steps`). It implements
:class:`lightning_llm.contract.StrategyContract` for callbacks and the CLI.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_llm._compat import lightning as compat
from lightning_llm.checkpointing import dcp as dcp_checkpoint
from lightning_llm.hf.load import load_pretrained
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.data_parallel import set_gradient_sync
from lightning_llm.parallel.float8 import check_fp8_device, precompute_fp8_scales, validate_fp8
from lightning_llm.parallel.init.materialize import materialize, record_init
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.parallelize import ParallelizeReport, PipelineSpec, parallelize
from lightning_llm.parallel.shutdown import destroy_process_group_at_exit
from lightning_llm.strategies.ac_planning import plan_checkpointing
from lightning_llm.strategies.checkpoint_hooks import ShardedCheckpointHooks
from lightning_llm.strategies.parallel_contract import ParallelContract
from lightning_llm.strategies.parallel_options import TRAINING_TIMEOUT, validate_arguments
from lightning_llm.strategies.pipeline_hooks import PipelineHooks
from lightning_llm.strategies.pipelined_steps import PipelinedSteps, build_pipelined_steps
from lightning_llm.strategies.precision import check_clipping, global_norm_precision
from lightning_llm.strategies.presets import PARALLEL_PRESETS, register_presets
from lightning_llm.strategies.zero_auto import decide_and_report, planning_inputs
from lightning_llm.validation import check_int, check_timeout

log = logging.getLogger(__name__)


class LLMParallelStrategy(ParallelContract, PipelineHooks, ShardedCheckpointHooks, ModelParallelStrategy):
    """Train an ordinary LightningModule LLM with ZeRO data parallelism and tensor (+ sequence) parallelism.

    Unlike Lightning's ``ModelParallelStrategy`` the user writes no ``configure_model``
    parallelization: the strategy finds the transformer blocks, derives a tensor-parallel plan
    and applies, in order, TP/SP, activation checkpointing, per-block ``torch.compile`` and
    FSDP2 (see :mod:`lightning_llm.parallel.data_parallel` for what each ZeRO stage maps to).
    Checkpoints are sharded with ``torch.distributed.checkpoint`` and load into any layout.

    Arguments:
        tensor_parallel_size: ranks that split each layer's matrices (innermost mesh axis).
        data_parallel_size: model replicas reading different data; ``"auto"`` = world size / tp.
        data_parallel_replicate_size: with ZeRO 2/3, groups that replicate rather than shard (HSDP);
            sharding then spans ``data_parallel_size / data_parallel_replicate_size`` ranks.
        zero_stage: 0 (replicated), 1 and 2 (optimizer state and gradients sharded), 3 (everything sharded), or
            "auto": the least-communication stage (then CPU offload) that the memory planner finds fits.
        device_memory: bytes (or "80GB") per device for "auto" planning; default: what the device reports.
        micro_batch_size: samples per micro-batch for "auto" planning (default: the datamodule's ``batch_size``,
            else the first training batch).
        seq_len: tokens per sample for "auto" planning (default: the datamodule's ``seq_len``, else the first batch) and
            for balancing pipeline stages by modelled FLOPs (default: the datamodule's ``seq_len``, else none).
        sequence_parallel: shard activations between blocks along the sequence (needs tp > 1).
        tensor_parallel_plan: module-name patterns (fnmatch, as in ``named_modules()`` of the
            LightningModule) to styles: "colwise", "rowwise", "colwise_gather", "embedding",
            "sequence_parallel", "replicate". Overrides the automatic plan.
        blocks: dotted name of the ``nn.ModuleList`` of transformer blocks, if discovery picks the wrong one.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy).
        compile_blocks: ``torch.compile`` each block.
        fp8: train the blocks' Linear layers in fp8 with torchao's float8 (``pip install 'lightning_llm[fp8]'``):
            ``True``/"tensorwise" or "rowwise" scaling. Use it with ``precision="bf16-mixed"``: everything
            but those matmuls stays in bf16. The output head, layers with dims not divisible by 16 and
            ``fp8_exclude`` patterns are skipped. Needs compute capability >= 8.9 on CUDA (H100, L40S, ...).
        fp8_exclude: module-name patterns (fnmatch, as in ``named_modules()``) kept out of fp8.
        save_distributed_checkpoint: save one shard per rank (``True``) or a full checkpoint on rank 0.
        process_group_backend: "nccl", "gloo", ...; the default follows the device.
        timeout: how long a collective may wait for the other ranks (a ``timedelta`` or seconds; NCCL and gloo),
            10 minutes by default rather than torch's 30: long enough for a checkpoint save or the first step's
            compilation, short enough that a rank that stopped responding does not hold the job for half an hour.
            Add :class:`~lightning_llm.callbacks.RankWatchdog` to learn which rank it was.
        load_pretrained: a local Hugging Face checkpoint directory (safetensors, single or sharded with its
            index) loaded into the sharded model before training; its tensor names must match the module's
            parameter names after a common prefix (e.g. a LightningModule holding ``self.model = LlamaForCausalLM``).

    Example::

        trainer = L.Trainer(
            devices=8, strategy=LLMParallelStrategy(tensor_parallel_size=2, zero_stage=3, sequence_parallel=True)
        )
        trainer.fit(CausalLM("1B"), LLMDataModule(...))
    """

    strategy_name = "llm_parallel"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_replicate_size: int = 1,
        zero_stage: Literal[0, 1, 2, 3, "auto"] = 3,
        sequence_parallel: bool = False,
        tensor_parallel_plan: dict[str, str] | None = None,
        blocks: str | None = None,
        cpu_offload: bool = False,
        compile_blocks: bool = False,
        fp8: bool | Literal["tensorwise", "rowwise"] = False,
        fp8_exclude: list[str] | None = None,
        pipeline_schedule: Literal[
            "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "LoopedBFS"
        ] = "1F1B",
        num_microbatches: int | None = None,
        virtual_stages: int | None = None,
        pipeline_split: list[list[str]] | None = None,
        activation_checkpointing: Literal["none", "full", "selective", "auto"] = "none",
        activation_checkpointing_options: ACOptions | dict | None = None,
        device_memory: int | str | None = None,
        micro_batch_size: int | None = None,
        seq_len: int | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = TRAINING_TIMEOUT,
        load_pretrained: str | None = None,
    ) -> None:
        validate_arguments(
            tensor_parallel_size,
            pipeline_parallel_size,
            data_parallel_size,
            data_parallel_replicate_size,
            zero_stage,
            sequence_parallel,
            num_microbatches,
            virtual_stages,
            device_memory,
        )
        timeout = check_timeout("timeout", timeout)
        check_int("micro_batch_size", micro_batch_size, minimum=1, optional=True)
        check_int("seq_len", seq_len, minimum=1, optional=True)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.zero_stage = zero_stage
        self.device_memory, self.micro_batch_size, self.seq_len = device_memory, micro_batch_size, seq_len
        self.decision = None  # the planner's ZeroDecision once zero_stage="auto" is resolved
        self.sequence_parallel = sequence_parallel
        self.tensor_parallel_plan = tensor_parallel_plan
        self.blocks = blocks
        self.cpu_offload = cpu_offload
        self.compile_blocks = compile_blocks
        self.fp8 = validate_fp8(fp8)
        if self.fp8 is not None and tensor_parallel_size > 1:
            raise ValueError(
                f"fp8={fp8!r} with tensor_parallel_size={tensor_parallel_size} is not supported yet (torchao's float8 "
                "needs its own tensor-parallel styles); use fp8 with data and pipeline parallelism, or fp8=False."
            )
        self.fp8_exclude = list(fp8_exclude or [])
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.pipeline = PipelineSpec(pipeline_schedule, num_microbatches, virtual_stages, pipeline_split)
        if pipeline_parallel_size > 1 and not save_distributed_checkpoint:
            raise ValueError(
                f"save_distributed_checkpoint=False with pipeline_parallel_size={pipeline_parallel_size}: rank 0 holds "
                "only the first stage, so a full checkpoint written by it would lack the others. Keep "
                "save_distributed_checkpoint=True (consolidate with `python -m lightning_llm.checkpoint`)."
            )
        if pipeline_parallel_size > 1:
            stages = pipeline_parallel_size * self.pipeline.stages_per_rank()
            self.pipeline.num_microbatches = num_microbatches or stages
            if self.pipeline.num_microbatches < pipeline_parallel_size:
                raise ValueError(
                    f"num_microbatches={num_microbatches} is fewer than pipeline_parallel_size={pipeline_parallel_size}: "
                    "ranks would idle for most of every step. Use at least as many micro-batches as pipeline ranks."
                )
        self._pipelined: PipelinedSteps | None = None
        self._saver = dcp_checkpoint.AsyncSaver()
        self.activation_checkpointing = activation_checkpointing
        self.ac_options = ACOptions.from_dict(activation_checkpointing, activation_checkpointing_options)
        self._ac_policies: list[str] = []
        self._model_shape: ModelShape | None = None
        self.parallel_dims: ParallelDims | None = None
        self.report: ParallelizeReport | None = None
        self.load_pretrained = load_pretrained

    @override
    def setup_environment(self) -> None:
        compat.setup_distributed(self)
        destroy_process_group_at_exit()
        self.parallel_dims = self._parallel_dims()
        compat.set_device_mesh(self, self.parallel_dims.build_mesh(self.root_device.type))

    def _parallel_dims(self) -> ParallelDims:
        return ParallelDims.for_world(
            self.world_size,
            tp=compat.tensor_parallel_size(self),
            pp=self.pipeline_parallel_size,
            dp=compat.data_parallel_size(self),
            dp_replicate=self.data_parallel_replicate_size,
            replicate_all=self.zero_stage == 0,
        )

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        """Models created in ``configure_model`` (or ``trainer.init_module()``) go on the meta device by default.

        Nothing is allocated until :meth:`setup` has split and sharded the model; each rank then
        allocates its own shards and runs the model's own init on them (see
        :mod:`lightning_llm.parallel.init.materialize`). ``trainer.init_module(empty_init=False)`` keeps eager init.
        """
        with super().tensor_init_context(empty_init=True if empty_init is None else empty_init):
            yield

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.parallel_dims.dp, "rank": self.parallel_dims.dp_rank()}

    @override
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        on_meta = any(p.is_meta for p in module.parameters())
        if not on_meta:
            module.to(self.root_device)
        try:  # read before the model is cut into shards and stages; MFUMonitor uses it
            self._model_shape = ModelShape.of(module, self.blocks)
        except ValueError:  # not a shape FLOP accounting understands; parallelize() says what is wrong
            self._model_shape = None
        self._check_microbatches(trainer)
        if self.zero_stage == "auto":
            self._choose_zero_stage(trainer, module)
        pipelined = self.pipeline_parallel_size > 1
        self._ac_policies, checkpointing = plan_checkpointing(
            trainer,
            module,
            find_blocks(module, self.blocks)[1],
            mode=self.activation_checkpointing,
            options=self.ac_options,
            tp=compat.tensor_parallel_size(self),
            sequence_parallel=self.sequence_parallel,
            num_microbatches=self.pipeline.num_microbatches if pipelined else None,
            device=self.root_device,
        )
        if pipelined:  # attention's share of each stage's modelled FLOPs; without it blocks count their matmuls
            hparams = trainer.datamodule.hparams if trainer.datamodule is not None else {}
            self.pipeline.seq_len = self.seq_len or hparams.get("seq_len")
        init_fills = record_init(module) if on_meta else None  # the whole model's init, before it is cut up
        self.report = parallelize(
            module,
            self.parallel_dims,
            zero_stage=self.zero_stage,
            precision=str(trainer.precision),
            sequence_parallel=self.sequence_parallel,
            tensor_parallel_plan=self.tensor_parallel_plan,
            blocks=self.blocks,
            cpu_offload=self.cpu_offload,
            compile_blocks=self.compile_blocks,
            pipeline=self.pipeline if pipelined else None,
            activation_checkpointing=checkpointing,
            fp8=check_fp8_device(self.fp8, self.root_device),
            fp8_exclude=self.fp8_exclude,
        )
        if on_meta:  # each rank allocates only its shards, filled as the unsharded model's own init would
            materialize(module, self.root_device, init_fills)
        if self.load_pretrained is not None:
            load_pretrained(module, self.load_pretrained)  # each rank reads only the slices it holds
        self.model = self.precision_plugin.convert_module(module)
        if not self.cpu_offload:
            self.model_to_device()
        if pipelined:
            self._pipelined = build_pipelined_steps(
                module,
                self.report,
                self.parallel_dims,
                schedule=self.pipeline.schedule,
                num_microbatches=self.pipeline.num_microbatches,
                device=self.root_device,
                sequence_parallel=self.sequence_parallel,
            )
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        check_clipping(self.precision_plugin, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        self._log_layout()

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.fp8 is not None and self.report is not None and self.report.fp8_layers:
            # With fp8 all-gather, every weight's scale in one all-reduce (a no-op without sharding).
            precompute_fp8_scales(self.lightning_module)
        return output

    def _log_layout(self) -> None:
        dims = self.parallel_dims
        rank_zero_info(
            f"LLMParallelStrategy: world={dims.world_size} pp={dims.pp} dp={dims.dp} (replicate={dims.dp_replicate}, "
            f"shard={dims.dp_shard}) tp={dims.tp} zero_stage={self.zero_stage}; {self.report.num_blocks} blocks at "
            f"{self.report.blocks_name!r}"
            + (f"; TP plan from {self.report.tp_plan_source}" if dims.tp > 1 else "")
            + (f"; fp8 ({self.fp8}) in {len(self.report.fp8_layers)} Linear layers" if self.fp8 else "")
        )

    def _choose_zero_stage(self, trainer, module) -> None:
        """Plan memory for every stage and take the least-communication one that fits (before training)."""
        dims = self.parallel_dims
        self.decision = decision = decide_and_report(
            trainer,
            module,
            name="LLMParallelStrategy",
            world_size=dims.world_size,
            tp=dims.tp,
            pp=dims.pp,
            dp_replicate=dims.dp_replicate,
            activation_checkpointing=self.activation_checkpointing,
            backend="native",
            allow_offload=True,
            **planning_inputs(trainer, self.root_device, self.device_memory, self.micro_batch_size, self.seq_len),
        )
        self.zero_stage, self.cpu_offload = decision.stage, decision.offload != "none"

    @property
    @override
    def precision_plugin(self) -> Precision:
        return ModelParallelStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's connector hands over the plugin chosen from precision=; take its global-norm twin.
        compat.set_precision_plugin(self, global_norm_precision(plugin, self.clip_by_global_norm))

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks that split each layer's matrices."""
        return compat.tensor_parallel_size(self)

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self):
        """Skip gradient reduction on accumulation steps; the last micro-batch reduces the sum."""
        set_gradient_sync(self.model, False)
        try:
            yield
        finally:
            set_gradient_sync(self.model, True)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(strategy_registry, cls, PARALLEL_PRESETS)
