"""Where a pipeline rank's step goes: a callback that times the parts of each step on its rank.

Per optimizer step, in ms (mean over the steps after the warm-up):

- ``compute``: the stages' ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
  (the last stage's head and loss included);
- ``head+loss``: of that, the last stage's part after its last block: forward from the last block's
  output to the chunk's end, backward from the chunk's start to the last block's output gradient;
- ``p2p wait``: blocked in torch's ``_wait_batch_p2p`` (sends and receives of activations/gradients:
  the bubble, imbalance between stages and transfer latency all land here);
- ``p2p issue``: posting the sends and receives (``_batch_p2p``);
- ``schedule other``: the rest of ``schedule.step`` (micro-batch splitting, bookkeeping);
- ``outside schedule``: the rest of the Lightning step (log broadcast, gradient hand-over, optimizer
  step, zero_grad, callbacks);
- ``log broadcast``: of that, sharing the last stage's logged metrics with every pipeline rank (a
  broadcast: the first rank to arrive waits there for the other to finish its schedule).

It wraps torch-internal functions by name (``torch.distributed.pipelining.schedules``), so it lives in
``benchmarks/`` and times nothing in the package's timed runs: the throughput rounds run without it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import lightning as L
from torch.distributed.pipelining import schedules

PARTS = ("compute", "head+loss", "p2p wait", "p2p issue", "schedule other", "outside schedule", "log broadcast")


class StageBreakdown(L.Callback):
    """Installs the timers on this rank's pipeline at train start; ``result()`` gives ms per step by part."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.steps = warmup, []
        self._now: dict[str, float] = defaultdict(float)
        self._marks: dict[str, float] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        pipelined = trainer.strategy.run_state.pipelined  # benchmark-only: the strategy's pipeline runtime
        schedule = pipelined.schedule
        self._wrap(schedule, "step", "schedule")
        self._wrap(pipelined, "_publish", "log broadcast")
        schedules._wait_batch_p2p = self._timed(schedules._wait_batch_p2p, "p2p wait")
        schedules._batch_p2p = self._timed(schedules._batch_p2p, "p2p issue")
        for stage in getattr(schedule, "_stages", [getattr(schedule, "_stage", None)]):
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                self._wrap(stage, name, "compute")
            if stage.is_last:
                last = next(c for c in pipelined.state.chunks if c.is_last)
                key = f"{trainer.strategy.report.blocks_name}.{last.blocks.stop - 1}".replace(".", "__")
                self._watch_head(stage, stage.submod.owned[key])

    def _watch_head(self, stage, block) -> None:
        """Time the last stage's work after ``block``, its last: forward to the chunk's end, backward to its gradient."""

        def reached(grad) -> None:
            if "bwd" in self._marks:  # shape inference runs a backward of its own first: count the chunks' only
                self._add("head+loss", time.perf_counter() - self._marks.pop("bwd"))

        def after_block(module, args, output):
            self._marks["head_fwd"] = time.perf_counter()
            if output.requires_grad:
                output.register_hook(reached)

        block.register_forward_hook(after_block)
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_then_mark(*args, **kwargs):
            out = forward(*args, **kwargs)
            if "head_fwd" in self._marks:
                self._add("head+loss", time.perf_counter() - self._marks.pop("head_fwd"))
            return out

        def backward_from_mark(*args, **kwargs):
            self._marks["bwd"] = time.perf_counter()
            return backward(*args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk = forward_then_mark, backward_from_mark

    def _add(self, part: str, seconds: float) -> None:
        self._now[part] += seconds

    def _timed(self, fn: Callable, part: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(part, time.perf_counter() - start)

        return timed

    def _wrap(self, obj, name: str, part: str) -> None:
        setattr(obj, name, self._timed(getattr(obj, name), part))

    def on_train_batch_start(self, *args) -> None:
        self._now = defaultdict(float)
        self._marks["step"] = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self._now["step"] = time.perf_counter() - self._marks["step"]
        self.steps.append(dict(self._now))

    def result(self) -> dict[str, float]:
        """Mean ms per step of each part (and ``step``, the whole step) over the steps after the warm-up."""
        steps = self.steps[self.warmup :]
        mean = {
            k: 1e3 * sum(s.get(k, 0.0) for s in steps) / len(steps)
            for k in ("step", "schedule", "compute", "head+loss", "p2p wait", "p2p issue", "log broadcast")
        }
        mean["schedule other"] = mean["schedule"] - mean["compute"] - mean["p2p wait"] - mean["p2p issue"]
        mean["outside schedule"] = mean["step"] - mean["schedule"]
        return mean


def format_breakdown(side: str, ranks: list[dict[str, float]]) -> str:
    """One markdown table: a row per rank, a column per part (ms per step, and its share of the step)."""
    lines = [
        f"{side}: ms per step by part (share of the step; head+loss is part of compute, log broadcast of outside schedule)",
        "",
        "| rank | step | " + " | ".join(PARTS) + " |",
        "| --- " * (len(PARTS) + 2) + "|",
    ]
    for rank, parts in enumerate(ranks):
        cells = [f"{parts[p]:.1f} ({parts[p] / parts['step']:.0%})" for p in PARTS]
        lines.append(f"| {rank} | {parts['step']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
