"""Where pipeline stages start and end, and which rank runs which stage.

Stages are contiguous runs of transformer blocks. The first stage also runs what comes before
the blocks (embeddings), the last what comes after (final norm, head, loss). The automatic split
balances modelled training FLOPs (:mod:`.costs`: blocks with attention's sequence term,
the head and its loss on the last stage, the embeddings on the first); an explicit split names the
blocks of each stage.
"""

from __future__ import annotations

import fnmatch
import itertools

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from lightning_llm._compat.versions import require_torch

SCHEDULES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "LoopedBFS": ScheduleLoopedBFS,
}
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SHAPED_SCHEDULES = ("ZBVZeroBubble",)


def validate_schedule(schedule: str, virtual_stages: int | None) -> int:
    """Check the schedule name; return the number of stages per rank it runs."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is unknown; choose one of {sorted(SCHEDULES)}.")
    if schedule in SINGLE_STAGE_SCHEDULES:
        if virtual_stages not in (None, 1):
            raise ValueError(
                f"pipeline_schedule={schedule!r} runs one stage per rank, but virtual_stages={virtual_stages}; "
                "use Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble or LoopedBFS for several."
            )
        return 1
    if schedule == "ZBVZeroBubble":
        require_torch(
            "2.13",
            "pipeline_schedule='ZBVZeroBubble'",
            "on torch 2.11 its first step's shape exchange between the two stages of one rank fails; "
            "InterleavedZeroBubble and every other schedule run there",
        )
    if schedule in V_SHAPED_SCHEDULES and virtual_stages not in (None, 2):
        raise ValueError(f"{schedule} places exactly 2 stages on each rank (a V); got virtual_stages={virtual_stages}.")
    stages = virtual_stages or 2
    if stages < 2:
        raise ValueError(f"pipeline_schedule={schedule!r} needs virtual_stages >= 2, got {virtual_stages}.")
    return stages


def stage_to_rank(num_stages: int, pp: int, schedule: str) -> list[int]:
    """The pipeline rank of each stage: round-robin ("looped"), or a V for the V-shaped schedules."""
    if schedule in V_SHAPED_SCHEDULES:
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def check_stages_fit(num_stages: int, num_blocks: int) -> None:
    """Refuse more pipeline stages than blocks: every stage needs at least one block."""
    if num_stages > num_blocks:
        raise ValueError(
            f"{num_stages} pipeline stages need at least as many transformer blocks, but the model has {num_blocks}; "
            "lower pipeline_parallel_size or virtual_stages."
        )


def balanced_split(block_costs: list[int], num_stages: int, head_cost: int = 0, first_cost: int = 0) -> list[range]:
    """Contiguous block ranges, one per stage, minimising the most expensive stage.

    The head's cost is added to the last stage, ``first_cost`` (embeddings) to the first. Exact
    search over split points: a few hundred blocks and tens of stages stay well under a second.
    """
    n = len(block_costs)
    check_stages_fit(num_stages, n)
    prefix = [0, *itertools.accumulate(block_costs)]

    def cost(start: int, stop: int, last: bool) -> int:
        return prefix[stop] - prefix[start] + (head_cost if last else 0) + (first_cost if start == 0 else 0)

    # best[s][i]: the lowest max-cost splitting blocks[:i] into s stages; choice[s][i]: start of the last one.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(j, i, last=s == num_stages))
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, j
    ranges, stop = [], n
    for s in range(num_stages, 0, -1):
        start = choice[s][stop]
        ranges.append(range(start, stop))
        stop = start
    return ranges[::-1]


def explicit_split(
    split: list[list[str]], blocks_name: str, num_blocks: int, num_stages: int, names: list[str] | None = None
) -> list[range]:
    """Block ranges from module names per stage (fnmatch patterns allowed, e.g. ``"model.layers.[0-3]"``).

    ``names``: each block's dotted name (:func:`~lightning_llm.modeling.blocks.block_names`, for a
    Sequential with keys of its own); default ``blocks_name.0`` ... ``blocks_name.{num_blocks - 1}``.
    """
    if len(split) != num_stages:
        raise ValueError(
            f"pipeline_split has {len(split)} stages but the schedule runs {num_stages}; give one list per stage."
        )
    names = names or [f"{blocks_name}.{i}" for i in range(num_blocks)]
    ranges = []
    for stage, patterns in enumerate(split):
        indices = sorted({i for p in patterns for i, n in enumerate(names) if fnmatch.fnmatchcase(n, p)})
        missing = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if missing:
            raise ValueError(
                f"pipeline_split stage {stage} names {missing}, which match no block; blocks are "
                f"{names[0]!r} ... {names[-1]!r}."
            )
        if indices != list(range(indices[0], indices[-1] + 1)):
            raise ValueError(f"pipeline_split stage {stage} is not a contiguous run of blocks: {indices}.")
        ranges.append(range(indices[0], indices[-1] + 1))
    covered = [i for r in ranges for i in r]
    if covered != list(range(num_blocks)):
        raise ValueError(f"pipeline_split must cover blocks 0..{num_blocks - 1} once, in order; it covers {covered}.")
    return ranges
