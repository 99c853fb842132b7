"""Timing shared by the benchmark scripts (run as ``python benchmarks/<name>.py``, so this sits on sys.path).

Every comparison alternates its sides round by round in one process tree, in a shuffled order per
round (the same order on every rank: the generator is seeded), and reports the per-round ratio as
median with min and max. One run of each side cannot tell a 3% effect from a shared machine's noise;
the spread over rounds says how far a figure can be trusted.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import lightning as L


class StepTimer(L.Callback):
    """Wall time of each training step, from batch start to batch end (CPU runs: no device sync needed)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)


def alternate(sides: Sequence[str], run: Callable[[str], float], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Call ``run(side)`` once per side per round, sides shuffled per round; the values per side, in round order.

    Example::

        times = alternate(["ours", "lightning"], lambda side: median_step_time(side), rounds=5)
        print(spread(ratios(times["ours"], times["lightning"])))
    """
    order = random.Random(seed)
    values: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side in order.sample(list(sides), len(sides)):
            values[side].append(run(side))
    return values


def ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-round ratios of two sides measured in the same rounds."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def spread(values: Sequence[float], digits: int = 3) -> str:
    """``median X (min A, max B, n rounds)``: how a per-round figure is quoted."""
    return (
        f"median {statistics.median(values):.{digits}f} (min {min(values):.{digits}f}, "
        f"max {max(values):.{digits}f}, {len(values)} rounds)"
    )


def median_after_warmup(times: Sequence[float], warmup: int) -> float:
    """Median step time without the first ``warmup`` steps (lazy initialisation, allocator growth)."""
    if len(times) <= warmup:
        raise ValueError(f"{len(times)} steps timed but {warmup} are warm-up; run more steps.")
    return statistics.median(times[warmup:])
