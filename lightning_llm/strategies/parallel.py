"""LLMParallelStrategy: ZeRO 0-3 data parallelism, tensor/sequence and pipeline parallelism for any LightningModule LLM.

The strategy translates Lightning's lifecycle into calls of plain functions and composed parts: its checked
options (:mod:`.parallel_options`) and the run's state (:mod:`.run_state`); the setup steps
(:mod:`.parallel_setup`: layout, ZeRO "auto" and activation-checkpointing planning, the parallelization itself);
sharded checkpoints (:class:`.sharded_checkpoints.ShardedCheckpoints`) and pipeline steps
(:mod:`.pipeline_routing`, :mod:`.pipelined_steps`). It implements :class:`lightning_llm.contract.StrategyContract`
for callbacks and the CLI (:mod:`.parallel_contract`); every Lightning hook and contract member is a short method here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llm._compat import lightning as compat
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.dcp import refuse_unverified
from lightning_llm.checkpointing.errors import save_on_every_rank
from lightning_llm.checkpointing.files import checkpoint_of
from lightning_llm.contract import ParallelLayout
from lightning_llm.contract.protocol import reduce_across_ranks
from lightning_llm.data.resume import resume_mid_epoch
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.data_parallel import accumulation_sync, syncs_every_micro_batch
from lightning_llm.parallel.float8 import precompute_fp8_scales
from lightning_llm.parallel.init.meta_writes import MetaWrites
from lightning_llm.parallel.shutdown import destroy_process_group_at_exit
from lightning_llm.strategies import applied_layouts, parallel_setup, pipeline_routing
from lightning_llm.strategies import parallel_contract as contract
from lightning_llm.strategies.parallel_contract import AsyncSave
from lightning_llm.strategies.parallel_options import TRAINING_TIMEOUT, build_options
from lightning_llm.strategies.precision import check_clipping, global_norm_precision
from lightning_llm.strategies.presets import PARALLEL_PRESETS, register_presets
from lightning_llm.strategies.run_state import Forwarded, RunState
from lightning_llm.strategies.sharded_checkpoints import ShardedCheckpoints, add_export_info


class LLMParallelStrategy(ModelParallelStrategy):
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
            "sequence_parallel", "replicate", ... (see the docs' tensor-parallel page). Merged per module with
            the module's ``tensor_parallel_plan()``, the model's Hugging Face ``_tp_plan`` and inference, in that
            order of precedence; a part of a block left whole on every rank is refused at setup.
        tensor_parallel_replicate: module-name patterns kept whole on every rank on purpose (e.g. ``["*.router"]``),
            exempt from that refusal and shown as replicated in the coverage report.
        blocks: dotted name of the ``nn.ModuleList`` or ``nn.Sequential`` of transformer blocks, if discovery
            (the container of layers holding most parameters, classes mixed or not) picks the wrong one; or the
            blocks' dotted names as a list, or a callable ``(name, module) -> bool`` choosing them, for blocks that
            share no container (ZeRO 0-3, activation checkpointing and compile only). A model with no container
            at all is sharded by its top-level units (see ``lightning_llm.modeling.blocks.default_units``).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy).
        compile_blocks: ``torch.compile`` each block.
        fp8: train the blocks' Linear layers in fp8 with torchao's float8 (``pip install 'lightning_llm[fp8]'``):
            ``True``/"tensorwise" or "rowwise" scaling. Use it with ``precision="bf16-mixed"``: everything
            but those matmuls stays in bf16. The output head, layers with dims not divisible by 16 and
            ``fp8_exclude`` patterns are skipped. With tensor parallelism (tensorwise only) the column- and
            row-split layers use torchao's float8 TP styles; other Linear layers of the blocks stay high precision.
            Needs compute capability >= 8.9 on CUDA (H100, L40S, ...).
        fp8_exclude: module-name patterns (fnmatch, as in ``named_modules()``) kept out of fp8.
        save_distributed_checkpoint: save one shard per rank (``True``) or a full checkpoint on rank 0.
        process_group_backend: "nccl", "gloo", ...; the default follows the device.
        timeout: how long a collective may wait for the other ranks (a ``timedelta`` or seconds; NCCL and gloo),
            10 minutes by default rather than torch's 30: long enough for a checkpoint save or the first step's
            compilation, short enough that a rank that stopped responding does not hold the job for half an hour.
            Add :class:`~lightning_llm.callbacks.RankWatchdog` to learn which rank it was.
        context_parallel_size: ranks that split every sequence (the ``cp`` mesh axis): each holds two head-tail
            (zig-zag) chunks of every sample from the embedding to the output, attention gathers the other ranks'
            keys/values, and the logits are gathered back, so the user's loss is computed unchanged and exactly. The
            CP ranks read the same batch; FSDP shards over data-parallel × CP ranks. The sequence length must be a
            multiple of ``2 * context_parallel_size``.
        context_parallel_method: "ring" (ring attention: key/value shards passed around the CP group, partial outputs
            merged by log-sum-exp) or "ulysses" (all-to-all to whole heads over the whole sequence and back; the
            query heads must divide by ``context_parallel_size * tensor_parallel_size``).
        load_pretrained: a local Hugging Face checkpoint directory (safetensors, single or sharded with its
            index) loaded into the sharded model before training; its tensor names must match the module's
            parameter names after a common prefix (e.g. a LightningModule holding ``self.model = LlamaForCausalLM``).

        expert_parallel_size: ranks, carved out of the data-parallel ones, over which the experts of every MoE
            layer are split (whole experts per rank; tokens move to them by all-to-all). It must divide the number
            of experts and the data-parallel size; under ZeRO 1-3 the experts are also sharded over the
            data-parallel ranks outside their group. See :mod:`lightning_llm.parallel.ep`.
        expert_parallel_plan: module-name pattern (fnmatch) -> ``"expert_parallel"`` (split a user's own experts
            module) or ``"data_parallel"`` (keep a found one whole); experts modules are otherwise found by shape.
        num_microbatches: with pipeline parallelism, micro-batches each step's per-rank batch is cut into. Unset, one
            sample per micro-batch (torchtitan's default, the smallest bubble the batch allows) when the per-rank
            batch size is known and a multiple of ``pipeline_parallel_size``, else one per stage; a bubble above
            25% of the step is warned about at setup, naming the count that would bring it under.
        accumulation_sync: with ``accumulate_grad_batches > 1``, how the micro-batches before the last one of a step
            reduce their gradients: "every_micro_batch" (reduce-scatter each, so gradients stay sharded: ZeRO 1-3
            keep their memory promise), "last_micro_batch" (no reduction until the last, like DDP's ``no_sync``:
            fewer collectives, but every rank holds the whole unsharded gradients meanwhile) or "auto" (the first
            at ZeRO 1-3, the second at ZeRO 0). Within one pipeline-parallel step torch's schedule reduces at the
            last of its micro-batches either way.

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
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = TRAINING_TIMEOUT,
        load_pretrained: str | None = None,
        expert_parallel_size: int = 1,
        expert_parallel_plan: dict[str, str] | None = None,
        context_parallel_size: int = 1,
        context_parallel_method: Literal["ring", "ulysses"] = "ring",
        accumulation_sync: Literal["auto", "every_micro_batch", "last_micro_batch"] = "auto",
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

    # The arguments as checked (read-only), and what the run resolves and builds (see RunState).
    tensor_parallel_size = Forwarded("options.parallel.tensor_parallel_size")
    pipeline_parallel_size = Forwarded("options.parallel.pipeline_parallel_size")
    data_parallel_replicate_size = Forwarded("options.parallel.data_parallel_replicate_size")
    sequence_parallel = Forwarded("options.parallel.sequence_parallel")
    tensor_parallel_plan = Forwarded("options.parallel.tensor_parallel_plan")
    tensor_parallel_replicate = Forwarded("options.parallel.tensor_parallel_replicate")
    blocks = Forwarded("options.parallel.blocks")
    compile_blocks = Forwarded("options.parallel.compile_blocks")
    fp8 = Forwarded("options.parallel.fp8")
    fp8_exclude = Forwarded("options.parallel.fp8_exclude")
    expert_parallel_size = Forwarded("options.parallel.expert_parallel_size")
    expert_parallel_plan = Forwarded("options.parallel.expert_parallel_plan")
    context_parallel_size = Forwarded("options.parallel.context_parallel_size")
    context_parallel_method = Forwarded("options.parallel.context_parallel_method")
    accumulation_sync = Forwarded("options.parallel.accumulation_sync")
    activation_checkpointing = Forwarded("options.planning.activation_checkpointing")
    ac_options = Forwarded("options.planning.ac_options")
    device_memory = Forwarded("options.planning.device_memory")
    micro_batch_size = Forwarded("options.planning.micro_batch_size")
    seq_len = Forwarded("options.planning.seq_len")
    load_pretrained = Forwarded("options.checkpointing.load_pretrained")
    zero_stage = Forwarded("run_state.zero_stage")
    cpu_offload = Forwarded("run_state.cpu_offload")
    decision = Forwarded("run_state.decision")
    pipeline = Forwarded("run_state.pipeline")
    parallel_dims = Forwarded("run_state.parallel_dims")
    report = Forwarded("run_state.report")

    @override
    def setup_environment(self) -> None:
        compat.setup_distributed(self)
        destroy_process_group_at_exit()
        if self.options.parallel.tensor_parallel_size == "auto":  # Lightning's meaning: every device of a node
            parallel = dataclasses.replace(self.options.parallel, tensor_parallel_size=self.num_processes)
            self.options = dataclasses.replace(self.options, parallel=parallel)
        self.run_state.parallel_dims = dims = parallel_setup.parallel_dims(self.options, self.world_size)
        compat.set_device_mesh(self, dims.build_mesh(self.root_device.type))

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
        return {"num_replicas": self.parallel_dims.dp, "rank": self.parallel_dims.dp_rank()}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # A user's training loader continues a resumed epoch where the checkpoint stopped (lightning_llm.data.resume).
        return resume_mid_epoch(dataloader, self.lightning_module.trainer)

    @override
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        module, state = self.lightning_module, self.run_state
        applied_layouts.refuse_fsdp1(module)
        # A second Trainer call finds the layout the first applied; a configure_model may have applied its own.
        reused = applied_layouts.reuse(module, self.options, state, self.world_size)
        if not reused and applied_layouts.adopt_user_layout(module, self.options, state):
            compat.materialize_distributed_module(module, self.root_device)  # a meta model, as Lightning does
        elif not reused:
            parallel_setup.parallelize_module(trainer, module, self.options, state, self.root_device)
        if not reused:
            applied_layouts.record(module, self.options, state, self.world_size)
        self.model = self.precision_plugin.convert_module(module)
        if not state.cpu_offload:
            self.model_to_device()
        parallel_setup.build_pipeline(module, self.options, state, self.root_device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        check_clipping(self.precision_plugin, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        self.checkpoints.check_checkpoint_io(self.checkpoint_io)
        if trainer.state.fn == TrainerFn.FITTING and not state.cpu_offload:
            compat.optimizers_to_device(self.optimizers, self.root_device)
        parallel_setup.log_layout(self.options, state)
        parallel_setup.log_global_batch(trainer, self.options, state)

    @override
    def on_train_start(self) -> None:
        # The first step's fp8 weight scales too, from the weights after any checkpoint load: without them FSDP2's
        # fp8 all-gather reduces each weight's amax over the dp axis only, so under TP each tp shard has its own.
        self._precompute_fp8_scales()

    @override
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.run_state.batch_line_pending:  # a plain DataLoader: the global batch read off the first batch
            parallel_setup.log_global_batch(self.lightning_module.trainer, self.options, self.run_state, batch)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
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
        compat.set_precision_plugin(self, global_norm_precision(plugin, self.clip_by_global_norm))

    @override
    def model_to_device(self) -> None:
        # Only what is elsewhere: a second Trainer call (test after fit) runs setup under torch.inference_mode, where
        # FSDP2 cannot swap its sharded parameters again.
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if any(t.device != self.root_device for t in tensors):
            self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self):
        """Accumulation (not last) micro-batches: reduce-scatter or skip the reduction, per ``accumulation_sync``."""
        every = syncs_every_micro_batch(self.options.parallel.accumulation_sync, self.zero_stage)
        with accumulation_sync(self.model, every_micro_batch=every):
            yield

    # Step hooks: through the pipeline schedule with pipeline parallelism (see .pipeline_routing), else the parent's.

    @override
    def training_step(self, *args, **kwargs):
        steps = self.run_state.pipelined
        if steps is None:
            return super().training_step(*args, **kwargs)
        batch, index = pipeline_routing.batch_and_index(args, kwargs)
        return pipeline_routing.training_step(steps, self.lightning_module, self.precision_plugin, batch, index)

    @override
    def validation_step(self, *args, **kwargs):
        if self.run_state.pipelined is None:
            return super().validation_step(*args, **kwargs)
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args, **kwargs):
        if self.run_state.pipelined is None:
            return super().test_step(*args, **kwargs)
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def _evaluation_step(self, name: str, context, args, kwargs) -> None:
        batch, index = pipeline_routing.batch_and_index(args, kwargs)
        pipeline_routing.evaluation_step(self.run_state.pipelined, self.lightning_module, name, context, batch, index)

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        steps = self.run_state.pipelined
        if steps is None:
            output = super().backward(closure_loss, optimizer, *args, **kwargs)
            guard = getattr(self.run_state.report, "output_guard", None)
            if guard is not None:
                guard.check()
            return output
        return pipeline_routing.backward(steps, self.lightning_module, self.precision_plugin, closure_loss)

    # Checkpoint hooks: sharded DCP through ShardedCheckpoints, or the parent's full file.

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name (see :mod:`lightning_llm.checkpointing.dcp`)."""
        if not self.checkpoints.distributed:
            return self.checkpoints.full_optimizer_state(self.model, optimizer)
        return self.checkpoints.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Lightning's ``ModelParallelStrategy`` rules: ``storage_options`` refused (TypeError), a sharded save over
        a file replaces it; a failed write raises the same error on every rank, also an instance of the
        original built-in type (``IsADirectoryError`` for a full-file save onto a directory)."""
        if storage_options is not None and not isinstance(storage_options, AsyncSave):
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported because "
                f"`{type(self).__name__}` writes through torch.distributed.checkpoint, not a CheckpointIO (as "
                "Lightning's ModelParallelStrategy); give fsspec options through the URL or the environment."
            )
        if self.lightning_module is not None:
            add_export_info(checkpoint, self.lightning_module)
        # A failed write raises the same SaveFailed on every rank, so no rank is left waiting in a collective.
        save_on_every_rank(lambda: self._write_checkpoint(checkpoint, filepath, storage_options), filepath)

    def _write_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None) -> None:
        path = self.broadcast(str(filepath))  # a local path or an fsspec URL, the same on every rank
        if self.checkpoints.distributed:  # a sharded save over a file replaces it, as Lightning's does
            if self.global_rank == 0 and cfs.isfile(path):
                cfs.remove_tree(path)
            self.barrier()
        if not self.checkpoints.save(checkpoint, path, self.global_rank, storage_options):
            storage_options = None if isinstance(storage_options, AsyncSave) else storage_options
            super().save_checkpoint(checkpoint, cfs.local_path(path), storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load into this layout, whatever layout saved it; strict unless ``strict_loading=False``; verified first.

        Also inside ``torch.inference_mode()`` (``trainer.test(ckpt_path=...)`` there): FSDP2's state-dict hooks
        cannot run on inference tensors, so the load runs outside it."""
        with torch.inference_mode(False):
            return self._load_checkpoint(checkpoint_path, weights_only)

    def _load_checkpoint(self, checkpoint_path, weights_only: bool | None) -> dict[str, Any]:
        self.checkpoints.wait()
        # A local path or an fsspec URL; a marker stands for its checkpoint where Lightning could not pick a directory
        # by time for ckpt_path="last" (lightning_llm.checkpointing.commit.last_candidate).
        path = checkpoint_of(self.broadcast(str(checkpoint_path)))
        refuse_unverified(self, path)
        trainer, strict = self.lightning_module._trainer, self.lightning_module.strict_loading
        # Optimizer state only to fit, as Lightning's connector restores it: a test after fit still holds them.
        optimizers = self.optimizers if trainer is None or trainer.state.fn == TrainerFn.FITTING else []
        return self.checkpoints.load(self.model, optimizers, path, strict, weights_only)

    def wait_for_checkpoint(self) -> None:
        """Block until the last asynchronous checkpoint is fully written on this rank."""
        self.checkpoints.wait()

    @override
    def teardown(self) -> None:
        try:
            self.checkpoints.finish()
        finally:
            super().teardown()

    # The StrategyContract members (documented there): calls of .parallel_contract's functions of the run state.

    @property
    def layout(self) -> ParallelLayout:
        return contract.layout(self.run_state, type(self).__name__, self.num_nodes)

    @property
    def model_shape(self) -> ModelShape | None:
        return self.run_state.model_shape

    @property
    def activation_checkpointing_policies(self) -> list[str]:
        return list(self.run_state.ac_policies)

    @property
    def blocks_name(self) -> str | list[str] | None:
        if self.report is None:
            return self.blocks
        return self.report.blocks_name or self.report.block_names or None

    @property
    def tensor_parallel_coverage(self) -> list[str]:
        return list(self.report.tp_coverage) if self.report is not None else []

    @property
    def pipeline_group(self):
        return contract.pipeline_group(self.run_state, self.pipeline_parallel_size)

    @property
    def supports_async_save(self) -> bool:
        return self.checkpoints.distributed

    @property
    def saves_to_urls(self) -> bool:
        """Whether checkpoints are DCP directories (torch's fsspec writer, so any URL) rather than one local file."""
        return self.checkpoints.distributed

    # Saves and loads go through save_checkpoint / load_checkpoint above (a failed write raises on every rank; loads
    # verify committed checkpoints); the gradient norm is read before the step; a torch optimizer's step leaves
    # parameters without gradients alone.
    saves_through_checkpoint_io = property(lambda self: False)
    loads_through_checkpoint_io = property(lambda self: False)
    grad_norm_ready = property(lambda self: "before_optimizer_step")
    can_skip_optimizer_step = property(lambda self: True)

    def step_grad_norm(self) -> torch.Tensor | None:
        return None  # read before the step (grad_norm), not computed inside it

    def reduce_across_ranks(self, tensor: torch.Tensor, op: Literal["sum", "mean", "max"] = "sum") -> torch.Tensor:
        """Reduce in place over every rank of the run (all data, tensor and pipeline peers) and return it."""
        return reduce_across_ranks(tensor, op, self.world_size)

    def grad_norm(self, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm of these parameters' gradients (default: all), as clipping sees it; equal on all ranks."""
        params = self.lightning_module.parameters() if parameters is None else parameters
        return contract.grad_norm(self.run_state, params, norm_type, self.pipeline_group)

    def save_checkpoint_async(self, filepath, weights_only: bool = False) -> Future:
        """Save with DCP's ``async_save`` (synchronous, future already done, with ``save_distributed_checkpoint=False``)."""
        return contract.save_checkpoint_async(self.lightning_module.trainer, filepath, weights_only)

    def clip_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip this optimizer's gradients by the global norm (the strategy's precision plugin calls this)."""
        contract.clip_by_global_norm(self.run_state, optimizer, clip_val, self.pipeline_group)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(strategy_registry, cls, PARALLEL_PRESETS)
