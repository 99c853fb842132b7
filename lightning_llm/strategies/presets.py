"""The named strategy presets both strategies register in Lightning's ``StrategyRegistry``.

Registered presets make ``Trainer(strategy="llm_tp2")`` and ``--trainer.strategy llm_deepspeed_zero3``
work; each is (name, init arguments, description), registered the same way for both strategies.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Preset(NamedTuple):
    name: str
    init_args: dict[str, Any]
    description: str


PARALLEL_PRESETS: list[Preset] = [
    ("llm_parallel", {}, "LLMParallelStrategy with its defaults (ZeRO 3 over every rank)"),
    ("llm_ddp", {"zero_stage": 0}, "LLMParallelStrategy: replicated data parallel (ZeRO 0)"),
    ("llm_zero2", {"zero_stage": 2}, "LLMParallelStrategy: gradients and optimizer state sharded (ZeRO 2)"),
    ("llm_zero3", {"zero_stage": 3}, "LLMParallelStrategy: fully sharded (ZeRO 3 / FSDP2)"),
    (
        "llm_zero_auto",
        {"zero_stage": "auto"},
        "LLMParallelStrategy: ZeRO stage and offload chosen by the memory planner",
    ),
    ("llm_tp2", {"tensor_parallel_size": 2}, "LLMParallelStrategy: tp=2, ZeRO 3 over the rest"),
    (
        "llm_tp2_sp",
        {"tensor_parallel_size": 2, "sequence_parallel": True},
        "LLMParallelStrategy: tp=2 + sequence parallel",
    ),
    (
        "llm_tp4_sp",
        {"tensor_parallel_size": 4, "sequence_parallel": True},
        "LLMParallelStrategy: tp=4 + sequence parallel",
    ),
    (
        "llm_tp8_sp",
        {"tensor_parallel_size": 8, "sequence_parallel": True},
        "LLMParallelStrategy: tp=8 + sequence parallel",
    ),
    ("llm_ep2", {"expert_parallel_size": 2}, "LLMParallelStrategy: MoE experts split over 2 ranks, ZeRO 3"),
    ("llm_ep4", {"expert_parallel_size": 4}, "LLMParallelStrategy: MoE experts split over 4 ranks, ZeRO 3"),
    (
        "llm_cp2",
        {"context_parallel_size": 2},
        "LLMParallelStrategy: sequences split over 2 ranks (ring attention), ZeRO 3 over data-parallel × CP ranks",
    ),
]

DEEPSPEED_PRESETS: list[Preset] = [
    ("llm_deepspeed", {}, "LLMDeepSpeedStrategy with its defaults (ZeRO 2)"),
    ("llm_deepspeed_zero1", {"zero_stage": 1}, "LLMDeepSpeedStrategy: ZeRO 1"),
    ("llm_deepspeed_zero2", {"zero_stage": 2}, "LLMDeepSpeedStrategy: ZeRO 2"),
    (
        "llm_deepspeed_zero2_offload",
        {"zero_stage": 2, "offload": "optimizer"},
        "LLMDeepSpeedStrategy: ZeRO 2, optimizer on CPU",
    ),
    ("llm_deepspeed_zero3", {"zero_stage": 3}, "LLMDeepSpeedStrategy: ZeRO 3"),
    (
        "llm_deepspeed_zero3_offload",
        {"zero_stage": 3, "offload": "optimizer+params"},
        "LLMDeepSpeedStrategy: ZeRO 3, optimizer and parameters on CPU",
    ),
    (
        "llm_deepspeed_auto",
        {"zero_stage": "auto", "offload": "auto"},
        "LLMDeepSpeedStrategy: stage and offload planned",
    ),
]


def register_presets(strategy_registry, strategy_class: type, presets: list[Preset]) -> None:
    """Register each preset of ``strategy_class`` (``override=True``: registering twice is harmless).

    Example::

        register_presets(StrategyRegistry, LLMDeepSpeedStrategy, DEEPSPEED_PRESETS)
    """
    for name, init_args, description in presets:
        strategy_registry.register(name, strategy_class, description=description, override=True, **init_args)
