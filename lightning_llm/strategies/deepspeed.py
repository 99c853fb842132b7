"""LLMDeepSpeedStrategy: Lightning's DeepSpeedStrategy with LLM defaults, planned ZeRO stages and a CPU path.

This module holds the strategy's lifecycle (config, environment, model building under ZeRO 3, "auto" planning, the
CPU path); its checkpoint hooks are :mod:`.deepspeed_checkpoint_hooks`, its contract members
:mod:`.deepspeed_contract`, its config :mod:`.deepspeed_config` and its refusals :mod:`.deepspeed_checks`.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from typing_extensions import override

from lightning_llm._compat.known_warnings import ScopedFilters
from lightning_llm._compat.lightning_strategies import (
    deepspeed_initialize_inference,
    deepspeed_setup_model_and_optimizer,
    init_deepspeed_config,
    init_deepspeed_distributed,
    reset_deepspeed_config,
)
from lightning_llm.checkpointing import resumed_settings
from lightning_llm.hf.load import load_pretrained
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.init.zero3_build import partition_meta_model, partitions_directly, zero_init
from lightning_llm.parallel.init.zero3_init import initialize_partitioned
from lightning_llm.parallel.shutdown import destroy_process_group_at_exit
from lightning_llm.strategies.deepspeed_checkpoint_hooks import DeepSpeedCheckpointHooksMixin
from lightning_llm.strategies.deepspeed_checks import (
    refuse_matrix_optimizers,
    require_deepspeed,
    require_deepspeed_cpu_accelerator,
)
from lightning_llm.strategies.deepspeed_config import (
    check_precision,
    default_config,
    merge_config,
    read_config,
    validate_args,
)
from lightning_llm.strategies.deepspeed_contract import DeepSpeedContractMixin
from lightning_llm.strategies.option_checks import check_optional_str
from lightning_llm.strategies.presets import DEEPSPEED_PRESETS, register_presets
from lightning_llm.strategies.zero_auto import decide_and_report, planning_inputs
from lightning_llm.validation import check_int, check_memory_size


class LLMDeepSpeedStrategy(DeepSpeedContractMixin, DeepSpeedCheckpointHooksMixin, DeepSpeedStrategy):
    """DeepSpeed ZeRO 1/2/3 with CPU/NVMe offload and LLM defaults; runs on CUDA, and on CPU with gloo for tests.

    The DeepSpeed config is :func:`~lightning_llm.strategies.deepspeed_config.default_config` for the chosen stage and offload, with the user's
    ``config`` (a dict or a JSON file) merged over it key by key; bf16/fp16 sections follow the Trainer's
    ``precision``. ``zero_stage="auto"`` asks the memory planner
    (``lightning_llm.planning.zero.plan_zero_stage``) for the least-communication stage that fits
    in device memory, just before DeepSpeed builds its engine, and logs its table.

    Arguments:
        zero_stage: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters) or "auto".
        offload: "none", "optimizer", "optimizer+params" (stage 3 only) or "auto" (with ``zero_stage="auto"``:
            the planner may offload when nothing else fits; ``zero_stage="auto"`` with "none" never offloads).
        offload_device: "cpu" or "nvme".
        nvme_path: a directory on a fast local disk, required for ``offload_device="nvme"``.
        config: a DeepSpeed config dict, or the path of a JSON file, merged over the defaults.
        device_memory: memory per device the planner may use, in bytes or as "80GB" / "24GiB" (default: the
            accelerator's total memory; on CPU the host's).
        micro_batch_size: samples per micro-batch, for the planner (default: the datamodule's ``batch_size``).
        seq_len: tokens per sample, for the planner (default: the datamodule's ``seq_len``).
        process_group_backend: default "nccl" on CUDA, "gloo" on CPU.
        load_pretrained: a local Hugging Face checkpoint directory (safetensors, single or sharded with its
            index) loaded into the model once it is built and initialized, before DeepSpeed builds its engine;
            under ZeRO 3 each rank reads only the rows covering its partitions
            (:func:`lightning_llm.hf.load_pretrained`). Missing, unexpected and mis-shaped tensors are refused.

    Example::

        trainer = L.Trainer(devices=8, precision="bf16-mixed",
                            strategy=LLMDeepSpeedStrategy(zero_stage=3, offload="optimizer"))
        # or by name: Trainer(strategy="llm_deepspeed_zero3"), --trainer.strategy=llm_deepspeed_auto
    """

    def __init__(
        self,
        zero_stage: Literal[1, 2, 3, "auto"] = 2,
        offload: Literal["none", "optimizer", "optimizer+params", "auto"] = "none",
        offload_device: Literal["cpu", "nvme"] = "cpu",
        nvme_path: str | None = None,
        config: dict | str | None = None,
        device_memory: int | str | None = None,
        micro_batch_size: int | None = None,
        seq_len: int | None = None,
        process_group_backend: str | None = None,
        load_pretrained: str | None = None,
    ) -> None:
        require_deepspeed()
        user_config = read_config(config)
        validate_args(zero_stage, offload, offload_device, nvme_path, user_config)
        check_int("micro_batch_size", micro_batch_size, minimum=1, optional=True)
        check_int("seq_len", seq_len, minimum=1, optional=True)
        check_memory_size("device_memory", device_memory)
        check_optional_str("nvme_path", nvme_path, "a directory on a fast local disk")
        check_optional_str("process_group_backend", process_group_backend, "a torch.distributed backend, e.g. 'nccl'")
        check_optional_str("load_pretrained", load_pretrained, "a Hugging Face checkpoint directory")
        self.requested_stage, self.requested_offload = zero_stage, offload
        self.offload_device, self.nvme_path = offload_device, nvme_path
        self.user_config = user_config
        self.device_memory, self.micro_batch_size, self.seq_len = device_memory, micro_batch_size, seq_len
        self.load_pretrained = load_pretrained
        self.decision: Any = None  # the planner's ZeroDecision once "auto" is resolved
        self._model_shape: ModelShape | None = None
        self._rng_before_model: torch.Tensor | None = None  # the CPU generator when configure_model began building
        self._zero_init: Any = None  # the deepspeed.zero.Init whose settings partition a model built on meta
        self._warning_filters = ScopedFilters()  # from setup_environment to teardown
        # Until "auto" is resolved in setup() the config holds stage 2: it shards no parameters, so the
        # model is built whole by configure_model, which runs before setup().
        stage = 2 if zero_stage == "auto" else zero_stage
        super().__init__(
            config=self._build_config(stage, "none" if offload == "auto" else offload),
            process_group_backend=process_group_backend,
        )

    def _build_config(self, stage: int, offload: str) -> dict[str, Any]:
        base = default_config(
            zero_stage=stage, offload=offload, offload_device=self.offload_device, nvme_path=self.nvme_path
        )
        return merge_config(base, self.user_config)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in effect (after "auto" has been resolved)."""
        return int(self.config["zero_optimization"]["stage"])

    @override
    def setup_environment(self) -> None:
        self._warning_filters.ignore_known()  # until teardown (lightning_llm._compat.known_warnings)
        check_precision(self.user_config, self.precision_plugin.precision)
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_environment()
            return
        require_deepspeed_cpu_accelerator()
        # Bypass: DeepSpeedStrategy.setup_environment refuses every accelerator but CUDA. DeepSpeed itself
        # runs on its CPU accelerator with gloo, so skip that one check and run the DDP/Strategy setup.
        super(DeepSpeedStrategy, self).setup_environment()

    @override
    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self._warning_filters.remove()

    @override
    def setup_distributed(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_distributed()
            return
        # Bypass: the parent first validates that CUDA device indices equal the local ranks; CPU devices
        # have no index. The rest is the parent's sequence.
        reset_seed()
        self.set_world_ranks()
        init_deepspeed_distributed(self)
        destroy_process_group_at_exit()

    @contextmanager
    @override
    def model_sharded_context(self):
        """Under ZeRO 3, the model of ``configure_model`` is built on the meta device (nothing allocated); :meth:`setup`
        then gives each parameter only this rank's partition (:mod:`lightning_llm.parallel.init.zero3_build`) and runs the
        model's own init into the partitions (:func:`lightning_llm.parallel.init.zero3_init.initialize_partitioned`), from
        the random state kept here. Configurations that module does not support (NVMe parameter offload, hpZ,
        quantized weights) build under Lightning's ``deepspeed.zero.Init`` instead, module by module."""
        self._rng_before_model = torch.get_rng_state()
        self._zero_init = None
        if self.zero_stage == 3:
            init_deepspeed_config(self)
            init = zero_init(self.config, self.remote_device)
            if partitions_directly(init) is None:
                self._zero_init = init
                with torch.device("meta"):
                    yield
                return
        with super().model_sharded_context():
            yield

    @override
    def setup(self, trainer) -> None:
        if self._rng_before_model is not None and self.zero_stage == 3:
            # Built on meta: allocate only this rank's partitions. Either way the model's own init runs now on the
            # partitions (under zero.Init it ran on empty placeholders and left torch's per-layer defaults).
            fresh = set()
            if self._zero_init is not None:
                fresh = partition_meta_model(self.lightning_module, self._zero_init)
            initialize_partitioned(self.lightning_module, self._rng_before_model, fresh=fresh)
        self._rng_before_model = self._zero_init = None
        if self.load_pretrained is not None:
            load_pretrained(self.lightning_module, self.load_pretrained)
        try:
            self._model_shape = ModelShape.of(self.lightning_module)
        except ValueError:  # not a decoder whose blocks can be found: MFUMonitor then needs flops_per_token
            self._model_shape = None
        if self.requested_stage == "auto":
            self._resolve_auto(trainer)
        self._size_buckets_to_model()
        super().setup(trainer)
        resumed_settings.remember(trainer)  # the configured values, before a checkpoint's state replaces them

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        resumed_settings.report(self.lightning_module.trainer)  # what the checkpoint's state replaced, said once

    def _size_buckets_to_model(self) -> None:
        """Shrink communication buckets the user did not set to the model's size: DeepSpeed allocates
        whole buckets up front, which for a small model would dwarf the model itself."""
        # Under stage 3 the parameters are already partitioned here; ``ds_numel`` keeps their full size.
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in self.lightning_module.parameters())
        zero, user_zero = self.config["zero_optimization"], self.user_config.get("zero_optimization", {})
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
            if key in zero and key not in user_zero:
                zero[key] = int(min(zero[key], numel))

    def _resolve_auto(self, trainer) -> None:
        """Ask the memory planner for the stage (and offload), before DeepSpeed builds its engine."""
        # The micro-batch shape comes from the strategy's arguments, else the datamodule's batch_size/seq_len.
        inputs = planning_inputs(trainer, self.root_device, self.device_memory, self.micro_batch_size, self.seq_len)
        self.decision = decide_and_report(
            trainer,
            self.lightning_module,
            name="LLMDeepSpeedStrategy",
            world_size=self.world_size,
            tp=1,
            pp=1,
            activation_checkpointing="none",
            backend="deepspeed",
            allow_offload=self.requested_offload == "auto",
            margin=0.1,
            **inputs,
        )
        # offload is "none" whenever it was not "auto"
        self.config = self._build_config(self.decision.stage, self.decision.offload)
        reset_deepspeed_config(self)  # Lightning formats the new config (batch size, precision) again

    @override
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        refuse_matrix_optimizers(optimizer)
        if not isinstance(self.accelerator, CPUAccelerator):
            return deepspeed_setup_model_and_optimizer(self, model, optimizer, lr_scheduler)
        engine, deepspeed_optimizer, _, _ = self._cpu_initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            config=self.config,
        )
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            deepspeed_initialize_inference(self, model)
            return
        config = {"train_micro_batch_size_per_gpu": 1}
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage == 3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        remove_module_hooks(model)
        self.model, _, _, _ = self._cpu_initialize(
            model=model, model_parameters=[], optimizer=None, lr_scheduler=None, config=config
        )

    def _cpu_initialize(self, **kwargs: Any):
        import deepspeed

        # Bypass: Lightning passes ``root_device.index`` as DeepSpeed's device rank, which is None on CPU
        # and fails DeepSpeed's ``device_rank >= 0``; its CPU accelerator takes the local rank.
        return deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), dist_init_required=False, **kwargs
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        register_presets(strategy_registry, cls, DEEPSPEED_PRESETS)
