"""LLMParallelStrategy: ZeRO 0-3 data parallelism, tensor/sequence and pipeline parallelism for any LightningModule LLM.

The strategy translates Lightning's lifecycle into calls of plain functions and composed parts: its options, each
declared once with its default, documentation and check (:mod:`.parallel_options`), and the run's state
(:mod:`.run_state`); the setup steps (:mod:`.parallel_setup`: layout, ZeRO "auto" and activation-checkpointing
planning, the parallelization itself) and the global batch line (:mod:`.global_batch`). Its other hooks come from bases, one concept each: checkpoints
(:mod:`.checkpoint_hooks`, through :class:`.sharded_checkpoints.ShardedCheckpoints`), the step hooks of pipeline
parallelism (:mod:`.pipeline_routing`) and the :class:`lightning_llm.contract.StrategyContract` members callbacks
and the CLI read (:mod:`.parallel_contract`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override

from lightning_llm._compat import lightning as compat
from lightning_llm._compat import lightning_strategies
from lightning_llm.checkpointing import resumed_settings
from lightning_llm.data.resume import RESUMED_MID_EPOCH, resume_mid_epoch
from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.data_parallel import accumulation_sync
from lightning_llm.parallel.float8 import precompute_fp8_scales
from lightning_llm.parallel.init.meta_writes import MetaWrites
from lightning_llm.parallel.shutdown import destroy_process_group_at_exit
from lightning_llm.strategies import applied_layouts, layout_choice, parallel_setup
from lightning_llm.strategies.checkpoint_hooks import CheckpointHooksMixin
from lightning_llm.strategies.declarations import Forwarded, with_declared_options
from lightning_llm.strategies.global_batch import log_global_batch
from lightning_llm.strategies.parallel_contract import ContractMembersMixin
from lightning_llm.strategies.parallel_options import TRAINING_TIMEOUT, StrategyOptions, build_options
from lightning_llm.strategies.pipeline_routing import PipelineStepHooksMixin
from lightning_llm.strategies.precision import check_clipping, global_norm_precision
from lightning_llm.strategies.presets import PARALLEL_PRESETS, register_presets
from lightning_llm.strategies.replica_groups import ReplicaGroupEnvironment, ReplicaGroups
from lightning_llm.strategies.run_state import RunState
from lightning_llm.strategies.sharded_checkpoints import ShardedCheckpoints


# The docstring's "{arguments}" line becomes every argument's entry, from its declaration in parallel_options.
@with_declared_options(StrategyOptions)
class LLMParallelStrategy(ContractMembersMixin, CheckpointHooksMixin, PipelineStepHooksMixin, ModelParallelStrategy):
    """Train an ordinary LightningModule LLM with ZeRO data parallelism and tensor (+ sequence) parallelism.

    Unlike Lightning's ``ModelParallelStrategy`` the user writes no ``configure_model``
    parallelization: the strategy finds the transformer blocks, derives a tensor-parallel plan
    and applies, in order, TP/SP, activation checkpointing, per-block ``torch.compile`` and
    FSDP2 (see :mod:`lightning_llm.parallel.data_parallel` for what each ZeRO stage maps to).
    Checkpoints are sharded with ``torch.distributed.checkpoint`` and load into any layout.

    Arguments:
        {arguments}

    Example::

        trainer = L.Trainer(
            devices=8, strategy=LLMParallelStrategy(tensor_parallel_size=2, zero_stage=3, sequence_parallel=True)
        )
        trainer.fit(CausalLM("1B"), LLMDataModule(...))
    """

    strategy_name = "llm_parallel"

    def __init__(
        self,
        tensor_parallel_size: int | Literal["auto"] = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_replicate_size: int = 1,
        zero_stage: Literal[0, 1, 2, 3, "auto"] = 3,
        sequence_parallel: bool = False,
        tensor_parallel_plan: dict[str, str] | None = None,
        tensor_parallel_replicate: list[str] | None = None,
        blocks: str | list[str] | Callable[[str, torch.nn.Module], bool] | None = None,
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
        layout: Literal["auto"] | None = None,
        layout_rates: str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = TRAINING_TIMEOUT,
        load_pretrained: str | None = None,
        expert_parallel_size: int = 1,
        expert_parallel_plan: dict[str, str] | None = None,
        context_parallel_size: int = 1,
        context_parallel_method: Literal["ring", "ulysses"] = "ring",
        accumulation_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto",
        fault_tolerance: bool | Literal["ddp", "local_sgd", "diloco"] = False,
        fault_tolerance_sync_every: int = 100,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        self.options = options = build_options(**arguments)  # every check, in one place
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=options.timeout,
        )
        self.run_state = RunState.before_setup(options)
        self.checkpoints = ShardedCheckpoints(distributed=save_distributed_checkpoint)

    # Every option is also a read-only attribute named as its argument (strategy.fp8, set by the decorator from
    # the declarations); these are what the run resolves and builds (see RunState), "auto" resolved.
    zero_stage = Forwarded("run_state.zero_stage")
    cpu_offload = Forwarded("run_state.cpu_offload")
    decision = Forwarded("run_state.decision")
    pipeline = Forwarded("run_state.pipeline")
    parallel_dims = Forwarded("run_state.parallel_dims")
    report = Forwarded("run_state.report")
    ac_options = Forwarded("options.planning.ac_options")  # activation_checkpointing_options, checked

    @override
    def setup_environment(self) -> None:
        self.run_state.warning_filters.ignore_known()  # until teardown (lightning_llm._compat.known_warnings)
        lightning_strategies.setup_distributed(self)
        destroy_process_group_at_exit()
        if self.options.parallel.tensor_parallel_size == "auto":  # Lightning's meaning: every device of a node
            parallel = dataclasses.replace(self.options.parallel, tensor_parallel_size=self.num_processes)
            self.options = dataclasses.replace(self.options, parallel=parallel)
        if self.options.fault_tolerance:  # before the first step: a launch without torchft's environment stops here
            self.run_state.replica_env = ReplicaGroupEnvironment.from_environ()
        if self.options.planning.layout != "auto":  # else setup() builds it for the layout chosen from the model
            self._build_mesh()

    def _build_mesh(self) -> None:
        self.run_state.parallel_dims = dims = parallel_setup.parallel_dims(self.options, self.world_size)
        lightning_strategies.set_device_mesh(self, dims.build_mesh(self.root_device.type))

    def _choose_layout(self, trainer) -> None:
        """layout="auto": the layout chosen from the configured model (once per job), then its mesh."""
        chosen, lines = layout_choice.choose_layout(
            trainer, self.lightning_module, self.options, self.root_device, self.world_size
        )
        self.options = layout_choice.chosen_options(self.options, chosen)
        state = self.run_state
        state.layout, state.zero_stage, state.pipeline = chosen, chosen.layout.zero_stage, self.options.pipeline.spec()
        layout_choice.report(trainer, chosen, lines)
        self._build_mesh()

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        """Models created in ``configure_model`` (or ``trainer.init_module()``) go on the meta device by default.

        Nothing is allocated until :meth:`setup` has split and sharded the model; each rank then
        allocates its own shards and runs the model's own init on them (see
        :mod:`lightning_llm.parallel.init.materialize`). ``trainer.init_module(empty_init=False)`` keeps eager init.
        Values the block copies into the meta tensors (``load_state_dict`` in ``configure_model``) are kept and
        written into each rank's shards after setup, as Lightning's eager build would keep them.
        """
        empty = True if empty_init is None else empty_init
        with super().tensor_init_context(empty_init=empty):
            if not empty:
                yield
                return
            # Values copied into the meta tensors (a configure_model loading known weights) are written back
            # after setup materializes the shards (lightning_llm.parallel.init.meta_writes).
            writes = self.run_state.meta_writes = self.run_state.meta_writes or MetaWrites()
            with writes, warnings.catch_warnings():
                # torch's "copying ... to a meta parameter is a no-op" is not true here: the values are kept.
                warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*to a meta parameter")
                yield

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dims, groups = self.parallel_dims, self.run_state.replica_env
        if groups is not None:  # this group's shard of the data, split over its data-parallel ranks
            return groups.sampler_kwargs(dims.dp, dims.dp_rank())
        return {"num_replicas": dims.dp, "rank": dims.dp_rank()}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # A user's training loader continues a resumed epoch where the checkpoint stopped (lightning_llm.data.resume).
        resumed = resume_mid_epoch(dataloader, self.lightning_module.trainer)
        if resumed is not dataloader:  # Lightning's hint that the loader is not resumable no longer holds for it
            self.run_state.warning_filters.ignore(RESUMED_MID_EPOCH, PossibleUserWarning)
        return resumed

    @override
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        module, state = self.lightning_module, self.run_state
        applied_layouts.refuse_fsdp1(module)
        if self.options.planning.layout == "auto":
            self._choose_layout(trainer)
        # A second Trainer call finds the layout the first applied; a configure_model may have applied its own.
        reused = applied_layouts.reuse(module, self.options, state, self.world_size)
        if not reused and applied_layouts.adopt_user_layout(module, self.options, state):
            compat.materialize_distributed_module(module, self.root_device)  # a meta model, as Lightning does
        elif not reused:
            parallel_setup.parallelize_module(trainer, module, self.options, state, self.root_device)
        if not reused:
            applied_layouts.record(module, self.options, state, self.world_size)
        if state.report.output_guard is not None:
            state.report.output_guard.silence()
        self.model = self.precision_plugin.convert_module(module)
        if not state.cpu_offload:
            self.model_to_device()
        parallel_setup.build_pipeline(module, self.options, state, self.root_device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if state.replica_env is not None:
                state.replica_groups = ReplicaGroups(
                    state.replica_env,
                    trainer,
                    rank=self.global_rank,
                    world_size=self.world_size,
                    timeout=self.options.timeout,
                    sync=self.options.fault_tolerance,
                    sync_every=self.options.fault_tolerance_sync_every,
                )
        self.setup_precision_plugin()
        check_clipping(self.precision_plugin, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        self.checkpoints.check_checkpoint_io(self.checkpoint_io)
        if trainer.state.fn == TrainerFn.FITTING and not state.cpu_offload:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        parallel_setup.log_layout(self.options, state)
        log_global_batch(trainer, self.options, state)
        resumed_settings.remember(trainer)  # the configured values, before a checkpoint's state replaces them

    @override
    def on_train_start(self) -> None:
        resumed_settings.report(self.lightning_module.trainer)  # what the checkpoint's state replaced, said once
        # The first step's fp8 weight scales too, from the weights after any checkpoint load: without them FSDP2's
        # fp8 all-gather reduces each weight's amax over the dp axis only, so under TP each tp shard has its own.
        self._precompute_fp8_scales()

    @override
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        trainer = self.lightning_module.trainer
        if self.run_state.batch_line_pending:  # a plain DataLoader: the global batch read off the first batch
            log_global_batch(trainer, self.options, self.run_state, batch)
        groups = self.run_state.replica_groups
        if groups is not None and groups.every_step and batch_idx % trainer.accumulate_grad_batches == 0:
            groups.start_step()  # the step's quorum forms during its forward

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        groups = self.run_state.replica_groups
        if (
            groups is not None and groups.every_step
        ):  # the closure, the average over the groups, the update if it commits
            loss = closure()
            groups.average_gradients()
            committed = groups.should_commit()
            self.lightning_module.log_dict(groups.metrics(), on_step=True, on_epoch=False, rank_zero_only=True)
            if not committed:
                return loss
            closure = lambda: loss  # noqa: E731 (Lightning's hooks after the closure still run: clipping, logging)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._precompute_fp8_scales()
        return output

    def _precompute_fp8_scales(self) -> None:
        if self.fp8 is not None and self.report is not None and self.report.fp8_layers:
            # With fp8 all-gather, every weight's scale in one all-reduce (a no-op without sharding).
            precompute_fp8_scales(self.lightning_module)

    @property
    @override
    def precision_plugin(self) -> Precision:
        return ModelParallelStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's connector hands over the plugin chosen from precision=; take its global-norm twin.
        lightning_strategies.set_precision_plugin(self, global_norm_precision(plugin, self.clip_by_global_norm))

    @override
    def model_to_device(self) -> None:
        # Only what is elsewhere: a second Trainer call (test after fit) runs setup under torch.inference_mode, where
        # FSDP2 cannot swap its sharded parameters again.
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if any(t.device != self.root_device for t in tensors):
            self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        try:
            super().teardown()
        finally:  # the run's warning filters go with it (lightning_llm._compat.known_warnings)
            report = self.run_state.report
            if report is not None and report.output_guard is not None:
                report.output_guard.close()
            self.run_state.warning_filters.remove()
            if self.run_state.replica_groups is not None:
                self.run_state.replica_groups.shutdown()
                self.run_state.replica_groups = None

    @contextmanager
    @override
    def block_backward_sync(self):
        """Accumulation (not last) micro-batches: reduce-scatter or skip the reduction, per ``accumulation_sync``."""
        self.run_state.accumulating = True
        try:
            with accumulation_sync(self.model, every_micro_batch=self._syncs_every_micro_batch()):
                yield
        finally:
            self.run_state.accumulating = False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(strategy_registry, cls, PARALLEL_PRESETS)
