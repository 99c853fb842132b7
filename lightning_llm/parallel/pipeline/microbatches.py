"""How many micro-batches a pipeline step cuts the per-rank batch into, and the bubble that leaves.

With ``p`` pipeline ranks, ``v`` stages per rank and ``m`` micro-batches, 1F1B, GPipe and their interleaved
forms leave every rank idle for ``(p - 1) / (v * m + p - 1)`` of a step (the Megatron-LM paper's bubble, with
interleaving dividing the warm-up by ``v``); the zero-bubble schedules fill most of it with split backward work.
The default follows torchtitan: micro-batches of one sample, so ``m`` is the per-rank batch size, the smallest
bubble the batch allows.
"""

from __future__ import annotations

import math

BUBBLE_WARNING = 0.25  # a larger idle fraction is warned about at setup


def default_microbatches(batch_size: int | None, pp: int, stages_per_rank: int) -> int:
    """One sample per micro-batch when the per-rank batch allows it, else one micro-batch per stage.

    Every schedule runs a count that is a multiple of ``pp`` and at least the number of stages, so a batch size
    that is not one of those falls back to the number of stages (the count the batch must then divide).

    Example::

        default_microbatches(8, pp=2, stages_per_rank=1)   # 8
        default_microbatches(None, pp=4, stages_per_rank=1)  # 4: batch size unknown
    """
    stages = pp * stages_per_rank
    if batch_size is not None and batch_size >= stages and batch_size % pp == 0:
        return batch_size
    return stages


def bubble_fraction(pp: int, stages_per_rank: int, num_microbatches: int) -> float:
    """Idle fraction of a step for 1F1B/GPipe (``stages_per_rank`` 1) and their interleaved forms.

    Example::

        bubble_fraction(4, 1, 4)  # 3 / 7 = 0.43
    """
    return (pp - 1) / (stages_per_rank * num_microbatches + pp - 1)


def bubble_warning(schedule: str, pp: int, stages_per_rank: int, num_microbatches: int) -> str | None:
    """A warning naming the fix when the bubble exceeds :data:`BUBBLE_WARNING`, else ``None``."""
    if pp == 1 or "ZeroBubble" in schedule:
        return None
    bubble = bubble_fraction(pp, stages_per_rank, num_microbatches)
    if bubble <= BUBBLE_WARNING:
        return None
    needed = math.ceil((pp - 1) * (1 - BUBBLE_WARNING) / BUBBLE_WARNING / stages_per_rank)
    needed = math.ceil(needed / pp) * pp  # a count every schedule runs
    return (
        f"pipeline_schedule={schedule!r} with num_microbatches={num_microbatches} over pipeline_parallel_size={pp} "
        f"({stages_per_rank} stage(s) per rank) leaves every rank idle for {bubble:.0%} of each step. Use at least "
        f"{needed} micro-batches (num_microbatches={needed} with a per-rank batch_size that is a multiple of it), "
        "more stages per rank (an interleaved schedule), or a zero-bubble schedule."
    )
