"""What a pipeline stage's run shares with the gates: the stages this rank holds and the one running now.

The schedule (:mod:`.stages`, :mod:`lightning_llm.strategies.pipelined_steps`) activates one stage at a time with
the activation it received; the gated block list (:mod:`.gates`) reads the active stage to decide which blocks run,
where the received activation goes in and where the stage's output leaves the user's forward (:class:`StageOutput`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


class StageOutput(Exception):
    """Raised after a non-last stage's last block to leave the user's forward with the hidden state."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


@dataclass
class StageChunk:
    """One pipeline stage held by this rank."""

    index: int
    blocks: range
    is_first: bool
    is_last: bool


@dataclass
class PipelineState:
    """What the running schedule needs: the active stage, the micro-batches and the step function."""

    chunks: list[StageChunk]
    num_microbatches: int
    active: StageChunk | None = None
    received: torch.Tensor | None = None
    microbatches: list = field(default_factory=list)
    step_fn: Callable | None = None
    batch_idx: int = 0
    loss_scale: float = 1.0
    logs: dict[int, dict[str, tuple[torch.Tensor, dict]]] = field(default_factory=dict)
    # Called with the stage as backward reaches its output of the last micro-batch (gradient reduction deferred to it).
    last_backward: Callable[[StageChunk], None] | None = None

    @contextmanager
    def activate(self, chunk: StageChunk, received: torch.Tensor | None):
        self.active, self.received = chunk, received
        try:
            yield
        finally:
            self.active, self.received = None, None
