"""LLMParallelStrategy's registered presets and the checks of its arguments."""

from __future__ import annotations

from lightning_llm.parallel.data_parallel import ZERO_STAGES

# (name, init arguments, description): registered in Lightning's StrategyRegistry, so Trainer(strategy="llm_tp2").
PRESETS = [
    ("llm_ddp", {"zero_stage": 0}, "LLMParallelStrategy: replicated data parallel (ZeRO 0)"),
    ("llm_zero2", {"zero_stage": 2}, "LLMParallelStrategy: gradients and optimizer state sharded (ZeRO 2)"),
    ("llm_zero3", {"zero_stage": 3}, "LLMParallelStrategy: fully sharded (ZeRO 3 / FSDP2)"),
    ("llm_zero_auto", {"zero_stage": "auto"}, "LLMParallelStrategy: ZeRO stage and offload chosen by the memory planner"),
    ("llm_tp2", {"tensor_parallel_size": 2}, "LLMParallelStrategy: tp=2, ZeRO 3 over the rest"),
    ("llm_tp2_sp", {"tensor_parallel_size": 2, "sequence_parallel": True}, "LLMParallelStrategy: tp=2 + sequence parallel"),
    ("llm_tp4_sp", {"tensor_parallel_size": 4, "sequence_parallel": True}, "LLMParallelStrategy: tp=4 + sequence parallel"),
    ("llm_tp8_sp", {"tensor_parallel_size": 8, "sequence_parallel": True}, "LLMParallelStrategy: tp=8 + sequence parallel"),
]


def validate_arguments(tp, dp, replicate, zero_stage, sequence_parallel) -> None:
    """Refuse impossible LLMParallelStrategy arguments before any process starts, naming the value and the fix."""
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
