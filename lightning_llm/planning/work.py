"""The work of one training forward on one rank, as :mod:`lightning_llm.modeling.op_work` records it and
:mod:`.step_time` prices it: FLOPs, bytes, launches, collectives. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Work:
    """Work of some ops, as one rank does it.

    Attributes:
        matmul_flops: FLOPs of ops torch counts FLOPs for (matmuls, convolutions, attention).
        matmuls: how many of those ops ran.
        other_bytes: bytes read and written by every other op (elementwise, norms, softmax: memory-bound).
        ops: ops launched.
        dispatches: ops dispatched, views included (what a Python dispatch mode sees).
        backward_bytes: bytes only the backward moves: a parameter read in parts (an expert's slice of stacked
            experts' weights) gets each part's gradient as a zero-filled whole that is then added into its gradient.
    """

    matmul_flops: float = 0.0
    matmuls: int = 0
    other_bytes: float = 0.0
    ops: int = 0
    dispatches: int = 0
    backward_bytes: float = 0.0

    def add(self, flops: float, nbytes: float) -> None:
        if flops:
            self.matmul_flops += flops
            self.matmuls += 1
        else:
            self.other_bytes += nbytes
        self.ops += 1

    def __iadd__(self, other: Work) -> Work:
        self.matmul_flops += other.matmul_flops
        self.matmuls += other.matmuls
        self.other_bytes += other.other_bytes
        self.ops += other.ops
        self.dispatches += other.dispatches
        self.backward_bytes += other.backward_bytes
        return self


@dataclass
class ForwardWork:
    """One micro-batch's forward on one rank: per block, outside the blocks, the collectives and attention calls.

    Attributes:
        blocks: the work of each block's forward.
        outside: the work outside the blocks (embedding, final norm, head, loss).
        collectives: (phase, kind, bytes of the whole tensor, block index or ``None``) per tensor-parallel collective
            of the step: phase "forward" or "backward", kind "all_reduce", "all_gather" or "reduce_scatter".
        attention_kv_bytes: per block, the bytes of the keys and values its attention calls read (whole sequence).
        attention_flops: per block, the FLOPs of its attention calls (what context parallelism's ring hides behind).
        stream_bytes: the bytes of the first block's input (the hidden states a pipeline stage sends on).
        experts: per block, the part of its work done inside experts modules (what expert parallelism spreads).
        routed_bytes: per block, the bytes of the routed token rows its experts modules receive (one row per token
            and chosen expert: what expert parallelism's all-to-alls move).
    """

    blocks: list[Work] = field(default_factory=list)
    outside: Work = field(default_factory=Work)
    collectives: list[tuple[str, str, int, int | None]] = field(default_factory=list)
    attention_kv_bytes: list[int] = field(default_factory=list)
    attention_flops: list[float] = field(default_factory=list)
    stream_bytes: int = 0
    experts: list[Work] = field(default_factory=list)
    routed_bytes: list[int] = field(default_factory=list)

    @property
    def total(self) -> Work:
        """All of the forward's work."""
        work = Work()
        for part in [*self.blocks, self.outside]:
            work += part
        return work


def summed(parts: list[Work]) -> Work:
    """The sum of ``parts`` (an empty :class:`Work` for none)."""
    total = Work()
    for part in parts:
        total += part
    return total
