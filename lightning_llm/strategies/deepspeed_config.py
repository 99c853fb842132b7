"""DeepSpeed configuration for LLM training: defaults per ZeRO stage and offload, merging, and validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What LLMDeepSpeedStrategy(zero_stage=...) accepts: DeepSpeed stages 1-3 (stage 0 is plain data
# parallelism) or "auto".
DEEPSPEED_ZERO_STAGE_CHOICES = (1, 2, 3, "auto")
OFFLOADS = ("none", "optimizer", "optimizer+params", "auto")


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
        zero.update(
            stage3_prefetch_bucket_size=5e7, stage3_param_persistence_threshold=1e5, stage3_max_live_parameters=1e9
        )
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


def validate_args(zero_stage, offload, offload_device, nvme_path, user_config: dict) -> None:
    """Refuse contradictory or unknown DeepSpeed strategy arguments, naming the value and the fix."""
    if zero_stage not in DEEPSPEED_ZERO_STAGE_CHOICES or isinstance(zero_stage, bool):
        raise ValueError(
            f"zero_stage={zero_stage!r} is not supported: choose 1, 2, 3 or 'auto' (DeepSpeed's "
            "stage 0 is plain data parallelism: use strategy='ddp')."
        )
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is unknown: choose one of {', '.join(map(repr, OFFLOADS))}.")
    if (offload == "auto") != (zero_stage == "auto") and offload != "none":
        raise ValueError(
            f"zero_stage={zero_stage!r} with offload={offload!r}: the planner chooses the stage and the "
            "offload together. Set both to 'auto' (offload='none' to forbid offloading), or neither."
        )
    if offload == "optimizer+params" and zero_stage != 3:
        raise ValueError(
            f"offload='optimizer+params' needs zero_stage=3 (got {zero_stage!r}): only stage 3 "
            "partitions parameters. Use offload='optimizer' with stages 1 and 2."
        )
    if offload_device not in ("cpu", "nvme"):
        raise ValueError(f"offload_device={offload_device!r} is unknown: choose 'cpu' or 'nvme'.")
    if offload_device == "nvme" and not nvme_path:
        raise ValueError("offload_device='nvme' needs nvme_path=<a directory on a fast local disk>.")
    stage_in_config = user_config.get("zero_optimization", {}).get("stage")
    if stage_in_config is not None and stage_in_config != zero_stage:
        raise ValueError(
            f"The DeepSpeed config sets zero_optimization.stage={stage_in_config} but "
            f"zero_stage={zero_stage!r}: remove the stage from the config and set it with zero_stage."
        )


def read_config(config: dict | str | None) -> dict[str, Any]:
    """The user's DeepSpeed config: a dict as given, or read from a JSON file."""
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
