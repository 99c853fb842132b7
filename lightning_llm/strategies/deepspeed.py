"""LLMDeepSpeedStrategy: Lightning's DeepSpeedStrategy with LLM defaults, planned ZeRO stages and a CPU path."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

ZERO_STAGES = (1, 2, 3, "auto")
OFFLOADS = ("none", "optimizer", "optimizer+params", "auto")
INSTALL_HINT = "pip install 'lightning_llm[deepspeed]'"


def _require_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"LLMDeepSpeedStrategy needs DeepSpeed, which could not be imported ({err}). "
            f"Install the extra: {INSTALL_HINT}"
        ) from err


def default_config(
    *, zero_stage: int, offload: str = "none", offload_device: str = "cpu", nvme_path: str | None = None
) -> dict[str, Any]:
    """DeepSpeed settings suited to LLM training, for one ZeRO stage and offload choice.

    Communication overlaps the backward pass in buckets of 200M elements (DeepSpeed's own default
    of 500M costs 1 GB of bf16 buffer per rank; the strategy also caps them at the model's size);
    gradients go to one contiguous buffer so they do not fragment memory. Precision (``bf16``/``fp16``),
    ``gradient_clipping``, ``gradient_accumulation_steps`` and the micro-batch size are left out on
    purpose: Lightning fills them from the Trainer (``precision``, ``gradient_clip_val``,
    ``accumulate_grad_batches``) and the train dataloader.

    Arguments:
        zero_stage: 1, 2 or 3.
        offload: "none", "optimizer" (optimizer state and its step on the host) or "optimizer+params"
            (stage 3 only: parameters as well).
        offload_device: "cpu" or "nvme".
        nvme_path: directory on a fast local disk, for ``offload_device="nvme"``.

    Example::

        config = default_config(zero_stage=3, offload="optimizer")
    """
    zero: dict[str, Any] = {
        "stage": zero_stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "allgather_bucket_size": 2e8,
    }
    if zero_stage == 3:
        # Parameters under 100k elements (norms, biases) stay whole on every rank: gathering them costs
        # more latency than the memory they would save.
        zero.update(stage3_prefetch_bucket_size=5e7, stage3_param_persistence_threshold=1e5,
                    stage3_max_live_parameters=1e9)
    device = {"device": offload_device, "pin_memory": True, **({"nvme_path": nvme_path} if nvme_path else {})}
    # The optimizer comes from LightningModule.configure_optimizers (usually torch AdamW), not the config.
    config: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = dict(device)
        # DeepSpeed refuses an offloaded step by any optimizer but its own DeepSpeedCPUAdam; the module's
        # optimizer works too, only slower: let it run (return DeepSpeedCPUAdam from configure_optimizers for speed).
        config["zero_force_ds_cpu_optimizer"] = False
    if offload == "optimizer+params":
        zero["offload_param"] = dict(device)
    return config


def merge_config(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``update`` laid over it; nested dicts are merged key by key, other values replaced."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = value
    return merged


def check_precision(config: dict[str, Any], precision: str) -> None:
    """Refuse a DeepSpeed config whose fp16/bf16 sections contradict the Trainer's ``precision``."""
    enabled = {name for name in ("fp16", "bf16") if config.get(name, {}).get("enabled", False)}
    wanted = {"16": {"fp16"}, "bf16": {"bf16"}}.get(precision.split("-")[0], set())
    if enabled - wanted:
        section = sorted(enabled - wanted)[0]
        raise ValueError(
            f"The DeepSpeed config enables {section!r} but the Trainer runs with precision={precision!r}: the two "
            f"must agree. Set Trainer(precision='{'bf16' if section == 'bf16' else '16'}-mixed') or remove the "
            f"{section!r} section and let the Trainer's precision decide."
        )


class LLMDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO 1/2/3 with CPU/NVMe offload and LLM defaults; runs on CUDA, and on CPU with gloo for tests.

    The DeepSpeed config is :func:`default_config` for the chosen stage and offload, with the user's
    ``config`` (a dict or a JSON file) merged over it key by key; bf16/fp16 sections follow the Trainer's
    ``precision``. ``zero_stage="auto"`` asks the memory planner
    (:func:`lightning_llm.planning.zero.choose_zero_stage`) for the least-communication stage that fits
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

    Example::

        trainer = L.Trainer(devices=8, precision="bf16-mixed",
                            strategy=LLMDeepSpeedStrategy(zero_stage=3, offload="optimizer"))
        # or by name: Trainer(strategy="llm_deepspeed_zero3"), --trainer.strategy=llm_deepspeed_auto
    """

    def __init__(
        self,
        zero_stage: int | Literal["auto"] = 2,
        offload: Literal["none", "optimizer", "optimizer+params", "auto"] = "none",
        offload_device: Literal["cpu", "nvme"] = "cpu",
        nvme_path: str | None = None,
        config: dict | str | None = None,
        device_memory: int | str | None = None,
        micro_batch_size: int | None = None,
        seq_len: int | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        _require_deepspeed()
        user_config = _read_config(config)
        _validate_args(zero_stage, offload, offload_device, nvme_path, user_config)
        self.requested_stage, self.requested_offload = zero_stage, offload
        self.offload_device, self.nvme_path = offload_device, nvme_path
        self.user_config = user_config
        self.device_memory, self.micro_batch_size, self.seq_len = device_memory, micro_batch_size, seq_len
        self.decision: Any = None  # the planner's ZeroDecision once "auto" is resolved
        # Until "auto" is resolved in setup() the config holds stage 2: it shards no parameters, so the
        # model is built whole by configure_model, which runs before setup().
        stage = 2 if zero_stage == "auto" else zero_stage
        super().__init__(config=self._build_config(stage, "none" if offload == "auto" else offload),
                         process_group_backend=process_group_backend)

    def _build_config(self, stage: int, offload: str) -> dict[str, Any]:
        base = default_config(zero_stage=stage, offload=offload, offload_device=self.offload_device,
                              nvme_path=self.nvme_path)
        return merge_config(base, self.user_config)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in effect (after "auto" has been resolved)."""
        return int(self.config["zero_optimization"]["stage"])

    @override
    def setup_environment(self) -> None:
        check_precision(self.user_config, self.precision_plugin.precision)
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_environment()
            return
        _require_deepspeed_cpu_accelerator()
        # Bypass: DeepSpeedStrategy.setup_environment refuses every accelerator but CUDA. DeepSpeed itself
        # runs on its CPU accelerator with gloo, so skip that one check and run the DDP/Strategy setup.
        super(DeepSpeedStrategy, self).setup_environment()

    @override
    def setup_distributed(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            super().setup_distributed()
            return
        # Bypass: the parent first validates that CUDA device indices equal the local ranks; CPU devices
        # have no index. The rest is the parent's sequence.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @override
    def setup(self, trainer) -> None:
        if self.requested_stage == "auto":
            self._resolve_auto(trainer)
        self._size_buckets_to_model()
        super().setup(trainer)

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
        from lightning_llm.planning.zero import choose_zero_stage, parse_size, planning_inputs

        memory = parse_size(self.device_memory) if self.device_memory is not None else None
        # The micro-batch shape comes from the strategy's arguments, else the datamodule's batch_size/seq_len.
        inputs = planning_inputs(trainer, self.root_device, memory, self.micro_batch_size, self.seq_len)
        self.decision = choose_zero_stage(
            self.lightning_module, world_size=self.world_size, tp=1, pp=1, precision=str(trainer.precision),
            activation_checkpointing="none", backend="deepspeed", allow_offload=self.requested_offload == "auto",
            margin=0.1, **inputs,
        )
        offload = self.decision.offload  # "none" whenever offload was not "auto"
        self.config = self._build_config(self.decision.stage, offload)
        self._config_initialized = False  # Lightning formats the new config (batch size, precision) again
        rank_zero_info(f"LLMDeepSpeedStrategy: zero_stage='auto' chose ZeRO {self.decision.stage}, offload "
                       f"{offload!r}:\n{self.decision.table}")
        for logger in trainer.loggers:
            logger.log_hyperparams({"zero_stage": self.decision.stage, "zero_offload": offload})

    @override
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        if not isinstance(self.accelerator, CPUAccelerator):
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        engine, deepspeed_optimizer, _, _ = self._cpu_initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer, lr_scheduler=lr_scheduler, config=self.config,
        )
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            super()._initialize_deepspeed_inference(model)
            return
        config = {"train_micro_batch_size_per_gpu": 1}
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage == 3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        remove_module_hooks(model)
        self.model, _, _, _ = self._cpu_initialize(model=model, model_parameters=[], optimizer=None,
                                                   lr_scheduler=None, config=config)

    def _cpu_initialize(self, **kwargs: Any):
        import deepspeed

        # Bypass: Lightning passes ``root_device.index`` as DeepSpeed's device rank, which is None on CPU
        # and fails DeepSpeed's ``device_rank >= 0``; its CPU accelerator takes the local rank.
        return deepspeed.initialize(args=argparse.Namespace(device_rank=self.local_rank), dist_init_required=False,
                                    **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        presets = {
            "llm_deepspeed_zero1": dict(zero_stage=1),
            "llm_deepspeed_zero2": dict(zero_stage=2),
            "llm_deepspeed_zero2_offload": dict(zero_stage=2, offload="optimizer"),
            "llm_deepspeed_zero3": dict(zero_stage=3),
            "llm_deepspeed_zero3_offload": dict(zero_stage=3, offload="optimizer+params"),
            "llm_deepspeed_auto": dict(zero_stage="auto", offload="auto"),
        }
        for name, init_args in presets.items():
            description = "LLMDeepSpeedStrategy " + ", ".join(f"{k}={v}" for k, v in init_args.items())
            strategy_registry.register(name, cls, description=description, override=True, **init_args)


def _validate_args(zero_stage, offload, offload_device, nvme_path, user_config: dict) -> None:
    if zero_stage not in ZERO_STAGES or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage={zero_stage!r} is not supported: choose 1, 2, 3 or 'auto' (DeepSpeed's "
                         "stage 0 is plain data parallelism: use strategy='ddp').")
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is unknown: choose one of {', '.join(map(repr, OFFLOADS))}.")
    if (offload == "auto") != (zero_stage == "auto") and offload != "none":
        raise ValueError(f"zero_stage={zero_stage!r} with offload={offload!r}: the planner chooses the stage and the "
                         "offload together. Set both to 'auto' (offload='none' to forbid offloading), or neither.")
    if offload == "optimizer+params" and zero_stage != 3:
        raise ValueError(f"offload='optimizer+params' needs zero_stage=3 (got {zero_stage!r}): only stage 3 "
                         "partitions parameters. Use offload='optimizer' with stages 1 and 2.")
    if offload_device not in ("cpu", "nvme"):
        raise ValueError(f"offload_device={offload_device!r} is unknown: choose 'cpu' or 'nvme'.")
    if offload_device == "nvme" and not nvme_path:
        raise ValueError("offload_device='nvme' needs nvme_path=<a directory on a fast local disk>.")
    stage_in_config = user_config.get("zero_optimization", {}).get("stage")
    if stage_in_config is not None and stage_in_config != zero_stage:
        raise ValueError(f"The DeepSpeed config sets zero_optimization.stage={stage_in_config} but "
                         f"zero_stage={zero_stage!r}: remove the stage from the config and set it with zero_stage.")


def _read_config(config: dict | str | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, Path)):
        raise TypeError(f"config must be a dict or the path of a JSON file, got {type(config).__name__}.")
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {str(path)!r} does not exist: pass a JSON file or a dict.")
    return json.loads(path.read_text())


def _require_deepspeed_cpu_accelerator() -> None:
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cpu":
        raise RuntimeError(
            f"Trainer(accelerator='cpu') with LLMDeepSpeedStrategy needs DeepSpeed's CPU accelerator, but DeepSpeed "
            f"selected {name!r}. Set the environment variable DS_ACCELERATOR=cpu before Python starts."
        )

