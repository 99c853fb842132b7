"""LLMParallelStrategy's default collective timeout and the checks of its arguments."""

from __future__ import annotations

from datetime import timedelta

from lightning_llm.parallel.data_parallel import FSDP2_ZERO_STAGES
from lightning_llm.validation import check_bool, check_choice, check_int, check_memory_size

# The collective timeout for training (see LLMParallelStrategy's `timeout` argument).
TRAINING_TIMEOUT = timedelta(minutes=10)


def validate_arguments(
    tp, pp, dp, replicate, zero_stage, sequence_parallel, num_microbatches=None, virtual_stages=None, device_memory=None
) -> None:
    """Refuse impossible LLMParallelStrategy arguments before any process starts, naming the value and the fix."""
    check_int("tensor_parallel_size", tp, minimum=1)
    check_int("pipeline_parallel_size", pp, minimum=1, hint="1 turns pipeline parallelism off")
    if dp != "auto":
        check_int("data_parallel_size", dp, minimum=1, hint="or 'auto' for world size / (tp * pp)")
    check_int("data_parallel_replicate_size", replicate, minimum=1)
    check_bool("sequence_parallel", sequence_parallel)
    check_int("num_microbatches", num_microbatches, minimum=1, optional=True)
    check_int("virtual_stages", virtual_stages, minimum=1, optional=True)
    check_memory_size("device_memory", device_memory)
    check_choice("zero_stage", zero_stage, (*FSDP2_ZERO_STAGES, "auto"))
    if zero_stage == 0 and replicate > 1:
        raise ValueError(
            "data_parallel_replicate_size > 1 (HSDP) needs zero_stage 2 or 3; zero_stage=0 already replicates everywhere."
        )
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tensor_parallel_size > 1 (it shards along the TP group).")
