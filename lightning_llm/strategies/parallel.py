"""LLMParallelStrategy: ZeRO 0-3 data parallelism, tensor/sequence and pipeline parallelism for any LightningModule LLM.

The strategy translates Lightning's lifecycle into calls of plain functions: the layout
(:mod:`lightning_llm.parallel.mesh`), the parallelization itself (:mod:`lightning_llm.parallel.parallelize`),
activation-checkpointing and ZeRO "auto" planning (:mod:`.ac_planning`, :mod:`.zero_auto`), sharded
checkpoints (:mod:`.dcp_checkpoint`) and pipeline steps (:mod:`.pipelined_steps`). It implements
:class:`lightning_llm.contract.StrategyContract` for callbacks and the CLI.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_llm.contract import ParallelLayout, completed
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.data_parallel import set_gradient_sync
from lightning_llm.hf.load import load_pretrained
from lightning_llm.parallel.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_llm.parallel.materialize import materialize, record_init
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.parallelize import ParallelizeReport, PipelineSpec, parallelize
from lightning_llm.strategies import dcp_checkpoint
from lightning_llm.strategies.ac_planning import plan_checkpointing
from lightning_llm.strategies.parallel_options import PRESETS, TRAINING_TIMEOUT, validate_arguments
from lightning_llm.strategies.pipeline_hooks import PipelineHooks
from lightning_llm.strategies.pipelined_steps import PipelinedSteps, build_pipelined_steps
from lightning_llm.strategies.zero_auto import decide_and_report, planning_inputs
from lightning_llm.validation import check_timeout

log = logging.getLogger(__name__)


class LLMParallelStrategy(PipelineHooks, ModelParallelStrategy):
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
        sequence_parallel: shard activations between blocks along the sequence (needs tp > 1).
        tensor_parallel_plan: module-name patterns (fnmatch, as in ``named_modules()`` of the
            LightningModule) to styles: "colwise", "rowwise", "colwise_gather", "embedding",
            "sequence_parallel", "replicate". Overrides the automatic plan.
        blocks: dotted name of the ``nn.ModuleList`` of transformer blocks, if discovery picks the wrong one.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy).
        compile_blocks: ``torch.compile`` each block.
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
        zero_stage: int | Literal["auto"] = 3,
        sequence_parallel: bool = False,
        tensor_parallel_plan: dict[str, str] | None = None,
        blocks: str | None = None,
        cpu_offload: bool = False,
        compile_blocks: bool = False,
        pipeline_schedule: str = "1F1B",
        num_microbatches: int | None = None,
        virtual_stages: int | None = None,
        pipeline_split: list[list[str]] | None = None,
        activation_checkpointing: str = "none",
        activation_checkpointing_options: dict | None = None,
        device_memory: int | str | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = TRAINING_TIMEOUT,
        load_pretrained: str | None = None,
    ) -> None:
        validate_arguments(tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
                           data_parallel_replicate_size, zero_stage, sequence_parallel, num_microbatches,
                           virtual_stages, device_memory)
        timeout = check_timeout("timeout", timeout)
        super().__init__(
            data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.zero_stage = zero_stage
        self.device_memory = device_memory
        self.sequence_parallel = sequence_parallel
        self.tensor_parallel_plan = tensor_parallel_plan
        self.blocks = blocks
        self.cpu_offload = cpu_offload
        self.compile_blocks = compile_blocks
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.pipeline = PipelineSpec(pipeline_schedule, num_microbatches, virtual_stages, pipeline_split)
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
        self._setup_distributed()
        self.parallel_dims = self._parallel_dims()
        self._device_mesh = self.parallel_dims.build_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    def _parallel_dims(self) -> ParallelDims:
        return ParallelDims.for_world(
            self.world_size, tp=self._tensor_parallel_size, pp=self.pipeline_parallel_size, dp=self._data_parallel_size,
            dp_replicate=self.data_parallel_replicate_size, replicate_all=self.zero_stage == 0,
        )

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        """Models created in ``configure_model`` (or ``trainer.init_module()``) go on the meta device by default.

        Nothing is allocated until :meth:`setup` has split and sharded the model; each rank then
        allocates its own shards and runs the model's own init on them (see
        :mod:`lightning_llm.parallel.materialize`). ``trainer.init_module(empty_init=False)`` keeps eager init.
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
            trainer, module, find_blocks(module, self.blocks)[1], mode=self.activation_checkpointing,
            options=self.ac_options, tp=self._tensor_parallel_size, sequence_parallel=self.sequence_parallel,
            num_microbatches=self.pipeline.num_microbatches if pipelined else None, device=self.root_device,
        )
        init_fills = record_init(module) if on_meta else None  # the whole model's init, before it is cut up
        self.report = parallelize(
            module, self.parallel_dims, zero_stage=self.zero_stage, precision=str(trainer.precision),
            sequence_parallel=self.sequence_parallel, tensor_parallel_plan=self.tensor_parallel_plan,
            blocks=self.blocks, cpu_offload=self.cpu_offload, compile_blocks=self.compile_blocks,
            pipeline=self.pipeline if pipelined else None, activation_checkpointing=checkpointing,
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
                module, self.report, self.parallel_dims, schedule=self.pipeline.schedule,
                num_microbatches=self.pipeline.num_microbatches, device=self.root_device,
                sequence_parallel=self.sequence_parallel,
            )
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning's precision plugins clip with torch.nn.utils.clip_grad_norm_, which cannot mix the
        # plain and DTensor gradients of a tensor-parallel model; the plugin itself is chosen by the
        # Trainer's `precision` flag, so its one clipping method is replaced here.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._log_layout()

    def _check_microbatches(self, trainer) -> None:
        """Refuse, before the first step, a per-rank batch the pipeline cannot cut into equal micro-batches."""
        hparams = getattr(trainer.datamodule, "hparams", {}) if trainer.datamodule is not None else {}
        batch_size, micro = hparams.get("batch_size"), self.pipeline.num_microbatches
        if self.pipeline_parallel_size > 1 and isinstance(batch_size, int) and batch_size % micro:
            raise ValueError(
                f"batch_size={batch_size} (per data-parallel rank) is not divisible by num_microbatches={micro}, so it "
                f"cannot be cut into equal micro-batches; use a batch_size that is a multiple of {micro}, or a "
                "num_microbatches that divides it."
            )

    def _log_layout(self) -> None:
        dims = self.parallel_dims
        rank_zero_info(
            f"LLMParallelStrategy: world={dims.world_size} pp={dims.pp} dp={dims.dp} (replicate={dims.dp_replicate}, "
            f"shard={dims.dp_shard}) tp={dims.tp} zero_stage={self.zero_stage}; {self.report.num_blocks} blocks at "
            f"{self.report.blocks_name!r}" + (f"; TP plan from {self.report.tp_plan_source}" if dims.tp > 1 else "")
        )

    def _choose_zero_stage(self, trainer, module) -> None:
        """Plan memory for every stage and take the least-communication one that fits (before training)."""
        dims = self.parallel_dims
        decision = decide_and_report(
            trainer, module, name="LLMParallelStrategy", world_size=dims.world_size, tp=dims.tp, pp=dims.pp,
            dp_replicate=dims.dp_replicate, activation_checkpointing=self.activation_checkpointing, backend="native",
            allow_offload=True, **planning_inputs(trainer, self.root_device, self.device_memory, None, None),
        )
        self.zero_stage, self.cpu_offload = decision.stage, decision.offload != "none"

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks that split each layer's matrices."""
        return self._tensor_parallel_size

    # The StrategyContract (lightning_llm.contract): what callbacks and the CLI read.

    @property
    def layout(self) -> ParallelLayout:
        """The parallel layout of this run (valid from ``setup_environment`` on)."""
        dims = self.parallel_dims
        return ParallelLayout(
            strategy=type(self).__name__, world_size=dims.world_size, num_nodes=self.num_nodes, tp=dims.tp, pp=dims.pp,
            dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, dp_rank=dims.dp_rank(),
            zero_stage=None if self.zero_stage == "auto" else self.zero_stage,
        )

    @property
    def model_shape(self) -> ModelShape | None:
        """The whole model's shape, read before it was sharded and cut into stages."""
        return self._model_shape

    @property
    def activation_checkpointing_policies(self) -> list[str]:
        """"none", "full" or "op" per transformer block."""
        return list(self._ac_policies)

    @property
    def blocks_name(self) -> str | None:
        """The dotted name of the transformer-block list (found, or given as ``blocks``)."""
        return self.report.blocks_name if self.report is not None else self.blocks

    @property
    def pipeline_group(self):
        """The process group of this rank's pipeline stages (``None`` without pipeline parallelism)."""
        return self.parallel_dims.mesh["pp"].get_group() if self.pipeline_parallel_size > 1 else None

    @property
    def supports_async_save(self) -> bool:
        return self._save_distributed_checkpoint

    def grad_norm(self, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of these parameters' gradients (default: all) across every shard and stage, as clipping sees it.

        Identical on all ranks; a weight tied across the first and last stage counts once.
        """
        skip = {id(p) for p in self._tied_copies()}
        params = self.lightning_module.parameters() if parameters is None else parameters
        return total_grad_norm([p for p in params if id(p) not in skip], norm_type, pipeline_group=self.pipeline_group)

    def save_checkpoint_async(self, filepath, weights_only: bool = False) -> Future:
        """Save the trainer's checkpoint with DCP's ``async_save``: returns once the state is copied to host memory.

        The future completes when this rank's files are written. Without sharded checkpoints
        (``save_distributed_checkpoint=False``) the save is synchronous and the future already done.
        """
        request = _AsyncSave()  # reaches save_checkpoint below through Lightning's storage_options argument
        self.lightning_module.trainer.save_checkpoint(filepath, weights_only=weights_only, storage_options=request)
        return request.future

    def _clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, clip_val, pipeline_group=self.pipeline_group, counted_elsewhere=self._tied_copies())

    def _tied_copies(self) -> list:
        # A weight tied across the first and last stages enters the norm once, from the first stage.
        if self._pipelined is None or self.parallel_dims.mesh["pp"].get_local_rank() != self.report.stage_ranks[-1]:
            return []
        return [param for param, _ in self._pipelined.tied_peers]

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (see :mod:`lightning_llm.strategies.dcp_checkpoint`)."""
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        return dcp_checkpoint.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if isinstance(storage_options, _AsyncSave):
            if self._save_distributed_checkpoint:
                storage_options.future = self._saver.save(checkpoint, Path(self.broadcast(str(filepath))), self.global_rank)
                return
            storage_options = None
        self._saver.wait()  # one save at a time: an asynchronous one still writing finishes first
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint into this layout, whatever layout saved it (DCP reshards by name)."""
        self._saver.wait()
        path = Path(self.broadcast(str(checkpoint_path)))
        return dcp_checkpoint.load(self.model, self.optimizers, path, self.lightning_module.strict_loading, weights_only)

    def wait_for_checkpoint(self) -> None:
        """Block until the last asynchronous checkpoint is fully written on this rank."""
        self._saver.wait()

    @override
    def teardown(self) -> None:
        self._saver.wait()
        super().teardown()

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
        for name, kwargs, description in PRESETS:
            strategy_registry.register(name, cls, description=description, **kwargs)



class _AsyncSave:
    """Asks :meth:`LLMParallelStrategy.save_checkpoint` to write in the background; it leaves the future here."""

    future: Future = completed()
