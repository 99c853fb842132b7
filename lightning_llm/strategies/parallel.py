"""LLMParallelStrategy: ZeRO 0-3 data parallelism and tensor/sequence parallelism for any LightningModule LLM."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import Shard
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_llm.parallel.activation_checkpointing import (
    ACOptions,
    ACReport,
    apply_activation_checkpointing,
    block_policies,
    plan_for_budget,
    resolve_budget,
)
from lightning_llm.parallel.activation_memory import device_memory, example_batch, measure_block_activations, silenced_logging
from lightning_llm.parallel.blocks import find_blocks
from lightning_llm.planning.flops import ModelShape
from lightning_llm.parallel.data_parallel import ZERO_STAGES, set_gradient_sync
from lightning_llm.parallel.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.parallel.parallelize import ParallelizeReport, PipelineSpec, parallelize
from lightning_llm.parallel.pipeline import PipelineState, build_stages, make_schedule, split_microbatches
from lightning_llm.strategies.pipelined_steps import PipelinedSteps

log = logging.getLogger(__name__)


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
        sequence_parallel: shard activations between blocks along the sequence (needs tp > 1).
        tensor_parallel_plan: module-name patterns (fnmatch, as in ``named_modules()`` of the
            LightningModule) to styles: "colwise", "rowwise", "colwise_gather", "embedding",
            "sequence_parallel", "replicate". Overrides the automatic plan.
        blocks: dotted name of the ``nn.ModuleList`` of transformer blocks, if discovery picks the wrong one.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy).
        compile_blocks: ``torch.compile`` each block.
        save_distributed_checkpoint: save one shard per rank (``True``) or a full checkpoint on rank 0.
        process_group_backend: "nccl", "gloo", ...; the default follows the device.
        timeout: collective timeout.

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
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout,
        )
        _validate_arguments(tensor_parallel_size, data_parallel_size, data_parallel_replicate_size, zero_stage, sequence_parallel)
        self.zero_stage = zero_stage
        self.device_memory = device_memory
        self.zero_decision = None
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
        self.async_checkpointing = False
        self._checkpoint_future = None
        self._checkpoint_group = None
        self.activation_checkpointing = activation_checkpointing
        self.ac_options = ACOptions.from_dict(activation_checkpointing, activation_checkpointing_options)
        self.ac_report: ACReport | None = None
        self.ac_policies: list[str] = []
        self.model_shape: ModelShape | None = None
        self.parallel_dims: ParallelDims | None = None
        self.report: ParallelizeReport | None = None

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self.parallel_dims = self._parallel_dims()
        self._device_mesh = self.parallel_dims.build_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    def _parallel_dims(self) -> ParallelDims:
        tp, pp = self._tensor_parallel_size, self.pipeline_parallel_size
        dp = self._data_parallel_size
        if dp == "auto":
            dp = ParallelDims(world_size=self.world_size, tp=tp, pp=pp).dp_shard
        elif dp * tp * pp != self.world_size:
            raise ValueError(
                f"data_parallel_size ({dp}) * tensor_parallel_size ({tp}) * pipeline_parallel_size ({pp}) = "
                f"{dp * tp * pp}, but there are {self.world_size} processes; make the product equal devices * nodes."
            )
        if self.zero_stage == 0:
            return ParallelDims(world_size=self.world_size, tp=tp, pp=pp, dp_replicate=dp, dp_shard=1)
        # "auto" decides in setup(); a (replicate, shard) mesh serves stage 0 too (through its flattened dp axis).
        replicate = self.data_parallel_replicate_size
        if dp % replicate:
            raise ValueError(
                f"data_parallel_replicate_size={replicate} does not divide the data-parallel size {dp}; "
                "choose a divisor so that each replica shards over the same number of ranks."
            )
        return ParallelDims(world_size=self.world_size, tp=tp, pp=pp, dp_replicate=replicate, dp_shard=dp // replicate)

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
            self.model_shape = ModelShape.of(module, self.blocks)
        except ValueError:  # not a shape FLOP accounting understands; parallelize() says what is wrong
            self.model_shape = None
        if self.zero_stage == "auto":
            self._choose_zero_stage(trainer, module)
        checkpointing = self._plan_activation_checkpointing(trainer, module)
        self.report = parallelize(
            module, self.parallel_dims, zero_stage=self.zero_stage, precision=str(trainer.precision),
            sequence_parallel=self.sequence_parallel, tensor_parallel_plan=self.tensor_parallel_plan,
            blocks=self.blocks, cpu_offload=self.cpu_offload, compile_blocks=self.compile_blocks,
            pipeline=self.pipeline if self.pipeline_parallel_size > 1 else None,
            activation_checkpointing=checkpointing,
        )
        if on_meta:
            _materialize_distributed_module(module, self.root_device)
        self.model = self.precision_plugin.convert_module(module)
        if not self.cpu_offload:
            self.model_to_device()
        if self.pipeline_parallel_size > 1:
            self._pipelined = self._build_pipeline(module)
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

    def _log_layout(self) -> None:
        dims = self.parallel_dims
        rank_zero_info(
            f"LLMParallelStrategy: world={dims.world_size} pp={dims.pp} dp={dims.dp} (replicate={dims.dp_replicate}, "
            f"shard={dims.dp_shard}) tp={dims.tp} zero_stage={self.zero_stage}; {self.report.num_blocks} blocks at "
            f"{self.report.blocks_name!r}" + (f"; TP plan from {self.report.tp_plan_source}" if dims.tp > 1 else "")
        )

    def _choose_zero_stage(self, trainer, module) -> None:
        """Plan memory for every stage and take the least-communication one that fits (before training)."""
        from lightning_llm.planning.zero import choose_zero_stage, parse_size, planning_inputs

        memory = parse_size(self.device_memory) if self.device_memory is not None else None
        dims = self.parallel_dims
        self.zero_decision = choose_zero_stage(
            module, world_size=dims.world_size, tp=dims.tp, pp=dims.pp, dp_replicate=dims.dp_replicate,
            precision=str(trainer.precision), activation_checkpointing=self.activation_checkpointing, backend="native",
            allow_offload=True, **planning_inputs(trainer, self.root_device, memory, None, None),
        )
        self.zero_stage, self.cpu_offload = self.zero_decision.stage, self.zero_decision.offload != "none"
        rank_zero_info(f"zero_stage='auto' chose ZeRO {self.zero_stage} (offload {self.zero_decision.offload}):\n"
                       f"{self.zero_decision.table}")
        for logger in trainer.loggers:
            logger.log_hyperparams({"zero_stage": self.zero_stage, "cpu_offload": self.cpu_offload})

    def _plan_activation_checkpointing(self, trainer, module):
        """The callable that checkpoints this rank's blocks; for "auto", measured and planned here, before training."""
        _, blocks = find_blocks(module, self.blocks)
        self.ac_policies = ["none"] * len(blocks)
        if self.activation_checkpointing == "none":
            return None
        index_of = {id(block): i for i, block in enumerate(blocks)}
        policies = None
        if self.activation_checkpointing == "auto":
            policies, predicted, budget, measured = self._auto_policies(trainer, module, list(blocks))
            rank_zero_info(
                f"Activation checkpointing 'auto': budget {budget / 2**20:.1f} MiB, measured "
                f"{sum(measured) / 2**20:.1f} MiB without checkpointing; checkpointing "
                f"{policies.count('full')} of {len(policies)} blocks -> {predicted / 2**20:.1f} MiB"
            )
        options = self.ac_options
        self.ac_policies = block_policies(
            self.activation_checkpointing, list(range(len(blocks))), options.selective, options.every_n_layers, policies
        )

        def apply(owned_blocks):
            indices = [index_of[id(b)] for b in owned_blocks]
            self.ac_report = apply_activation_checkpointing(
                owned_blocks, mode=self.activation_checkpointing, selective=self.ac_options.selective,
                every_n_layers=self.ac_options.every_n_layers,
                recompute_every_other_matmul=self.ac_options.recompute_every_other_matmul,
                auto_policies=[policies[i] for i in indices] if policies is not None else None,
                block_indices=indices,
            )

        return apply

    def _auto_policies(self, trainer, module, blocks):
        batch = example_batch(trainer, self.root_device)
        if self.pipeline_parallel_size > 1:
            batch = split_microbatches(batch, self.pipeline.num_microbatches)[0]
        with silenced_logging(module):
            sizes = measure_block_activations(module, blocks, lambda: module.training_step(batch, 0))
        tp, sp = self._tensor_parallel_size, self.sequence_parallel
        # Per rank: what a block keeps is split over tp (heads, MLP width); its input only under SP.
        saved = [s.saved // tp for s in sizes]
        inputs = [s.input // (tp if sp else 1) for s in sizes]
        budget = resolve_budget(self.ac_options.budget, self.ac_options.device_memory or device_memory(self.root_device))
        policies, predicted = plan_for_budget(saved, inputs, budget)
        return policies, predicted, budget, saved

    def _build_pipeline(self, module) -> PipelinedSteps:
        report, dims = self.report, self.parallel_dims
        state = PipelineState(chunks=report.chunks, num_microbatches=self.pipeline.num_microbatches)
        pp_group = dims.mesh["pp"].get_group()
        blocks = module.get_submodule(report.blocks_name)
        stages = build_stages(
            module, report.blocks_name, blocks, report.chunks, report.outer, state,
            num_stages=len(report.stage_ranks), device=self.root_device, group=pp_group,
            boundary_layout=(dims.mesh["tp"], (Shard(1),)) if self.sequence_parallel else None,
        )
        schedule = make_schedule(self.pipeline.schedule, stages, self.pipeline.num_microbatches)
        return PipelinedSteps(state, schedule, report.stage_ranks, pp_group, self._tied_peers(module))

    def _tied_peers(self, module) -> list:
        """Parameters shared by the first and last stages, with the pipeline rank holding the other copy."""
        ranks = self.report.stage_ranks
        first, last = ranks[0], ranks[-1]
        me = self.parallel_dims.mesh["pp"].get_local_rank()
        if first == last or me not in (first, last):
            return []
        present = dict(module.named_parameters(remove_duplicate=False))
        peers = []
        for names in self.report.tied:
            mine = [present[n] for n in names if n in present]
            if mine:
                peers.append((mine[0], last if me == first else first))
        return peers

    @property
    def pipeline_group(self):
        """The process group of this rank's pipeline stages (``None`` without pipeline parallelism)."""
        return self.parallel_dims.mesh["pp"].get_group() if self.pipeline_parallel_size > 1 else None

    @override
    def training_step(self, *args, **kwargs):
        if self._pipelined is None:
            return super().training_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        with self.precision_plugin.train_step_context():
            accumulate = self.lightning_module.trainer.accumulate_grad_batches
            return self._pipelined.training_step(self.lightning_module, batch, batch_idx, accumulate)

    @override
    def validation_step(self, *args, **kwargs):
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args, **kwargs):
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def _evaluation_step(self, name: str, context, *args, **kwargs):
        if self._pipelined is None:
            return getattr(super(), name)(*args, **kwargs)
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        with context():
            self._pipelined.evaluation_step(self.lightning_module, getattr(self.lightning_module, name), batch, batch_idx)
        return None

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self._pipelined is not None:  # the schedule already ran every micro-batch's backward
            module = self.lightning_module
            self.precision_plugin.pre_backward(closure_loss, module)  # Lightning's on_before_backward hooks
            self._pipelined.add_step_gradients(module)
            self.precision_plugin.post_backward(closure_loss, module)  # and on_after_backward
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, clip_val, pipeline_group=self.pipeline_group, counted_elsewhere=self._tied_copies())

    def _tied_copies(self) -> list:
        # A weight tied across the first and last stages enters the norm once, from the first stage.
        if self._pipelined is None or self.parallel_dims.mesh["pp"].get_local_rank() != self.report.stage_ranks[-1]:
            return []
        return [param for param, _ in self._pipelined.tied_peers]

    def global_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of all gradients across every shard and stage, as the clipping sees it (same on all ranks)."""
        skip = {id(p) for p in self._tied_copies()}
        params = [p for p in self.lightning_module.parameters() if id(p) not in skip]
        return total_grad_norm(params, norm_type, pipeline_group=self.pipeline_group)

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, hyperparameters included (torch's "flattened" form).

        Lightning's form keys param groups by their index; pipeline stages have different groups
        under the same index, so a sharded checkpoint could not tell them apart.
        """
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return get_optimizer_state_dict(self.model, optimizer, options=_FLAT_OPTIMIZER)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Lightning's sharded save, or with ``async_checkpointing`` set (by CheckpointRotation), DCP's async_save.

        async_save copies the state to host memory before returning; the files are written in the
        background until :meth:`wait_for_checkpoint`.
        """
        if not (self.async_checkpointing and self._save_distributed_checkpoint):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self.wait_for_checkpoint()
        path = Path(self.broadcast(filepath))
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self._checkpoint_group is None:
            # The background writer runs collectives of its own; on the training group they could
            # interleave with the training's collectives, so it gets a gloo group to itself.
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")
        self._checkpoint_future = dcp.async_save(state, checkpoint_id=path, process_group=self._checkpoint_group)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    def wait_for_checkpoint(self) -> None:
        """Block until the last asynchronous checkpoint is fully written on this rank."""
        if self._checkpoint_future is not None:
            self._checkpoint_future.result()
            self._checkpoint_future = None

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint into this layout, whatever layout saved it.

        torch.distributed.checkpoint reshards by parameter name: each rank asks for the tensors (or
        slices) it holds now, so pipeline stages, TP and ZeRO degrees may all differ from the save.
        """
        path = Path(self.broadcast(checkpoint_path))
        if not (path / ".metadata").is_file():
            raise ValueError(
                f"{path} is not a sharded checkpoint directory (no .metadata inside). LLMParallelStrategy resumes "
                "from checkpoints it saved; load a single-file checkpoint into the model before fitting instead."
            )
        strict = self.lightning_module.strict_loading
        model_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(model_state, checkpoint_id=path)
        set_model_state_dict(self.model, model_state["state_dict"], options=StateDictOptions(strict=strict))
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer, options=_FLAT_OPTIMIZER)}
            dcp.load(optimizer_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optimizer_state[key], options=_FLAT_OPTIMIZER)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

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
        for name, kwargs, description in _PRESETS:
            strategy_registry.register(name, cls, description=description, **kwargs)


_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)

_PRESETS = [
    ("llm_ddp", {"zero_stage": 0}, "LLMParallelStrategy: replicated data parallel (ZeRO 0)"),
    ("llm_zero2", {"zero_stage": 2}, "LLMParallelStrategy: gradients and optimizer state sharded (ZeRO 2)"),
    ("llm_zero3", {"zero_stage": 3}, "LLMParallelStrategy: fully sharded (ZeRO 3 / FSDP2)"),
    ("llm_zero_auto", {"zero_stage": "auto"}, "LLMParallelStrategy: ZeRO stage and offload chosen by the memory planner"),
    ("llm_tp2", {"tensor_parallel_size": 2}, "LLMParallelStrategy: tp=2, ZeRO 3 over the rest"),
    ("llm_tp2_sp", {"tensor_parallel_size": 2, "sequence_parallel": True}, "LLMParallelStrategy: tp=2 + sequence parallel"),
    ("llm_tp4_sp", {"tensor_parallel_size": 4, "sequence_parallel": True}, "LLMParallelStrategy: tp=4 + sequence parallel"),
    ("llm_tp8_sp", {"tensor_parallel_size": 8, "sequence_parallel": True}, "LLMParallelStrategy: tp=8 + sequence parallel"),
]


def _validate_arguments(tp, dp, replicate, zero_stage, sequence_parallel) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be a positive integer.")
    if dp != "auto" and (not isinstance(dp, int) or dp < 1):
        raise ValueError(f"data_parallel_size={dp!r} must be a positive integer or 'auto'.")
    if not isinstance(replicate, int) or replicate < 1:
        raise ValueError(f"data_parallel_replicate_size={replicate!r} must be a positive integer.")
    if zero_stage not in (*ZERO_STAGES, "auto"):
        raise ValueError(f"zero_stage={zero_stage!r} is not supported; choose one of {ZERO_STAGES} or 'auto'.")
    if zero_stage == 0 and replicate > 1:
        raise ValueError(
            "data_parallel_replicate_size > 1 (HSDP) needs zero_stage 2 or 3; zero_stage=0 already replicates everywhere."
        )
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tensor_parallel_size > 1 (it shards along the TP group).")
