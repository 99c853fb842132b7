"""Step timing shared by the benchmark scripts (run as ``python benchmarks/<name>.py``, so this sits on sys.path)."""

from __future__ import annotations

import time

import lightning as L


class StepTimer(L.Callback):
    """Wall time of each training step, from batch start to batch end (CPU runs: no device sync needed)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._start)
