"""Which tokens of a sequence each context-parallel rank holds: head-tail (zig-zag) load balancing.

Causal attention makes late tokens costlier than early ones (a query attends to every earlier key), so a plain
split into C contiguous shards leaves rank 0 nearly idle and rank C-1 doing most of the work. The sequence is cut
into 2C equal chunks instead and rank ``r`` holds chunks ``r`` and ``2C-1-r`` (one early, one late): every rank
then attends over the same number of (query, key) pairs. Positions here are always global (a token's index in the
whole sequence), which is what rotary tables and causal masks must see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPGroup:
    """A context-parallel group as the attention and sharding code need it: process group, size and own rank."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    method: str = "ring"  # "ring" (send/recv of key/value shards) or "ulysses" (all-to-all over heads)


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Refuse a sequence length that does not split into ``2 * cp`` equal chunks (zig-zag needs two per rank)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context_parallel_size={cp} splits every sequence into 2 * {cp} = {2 * cp} equal chunks (head-tail "
            f"load balancing), but the batch's sequence length {seq_len} is not divisible by {2 * cp}; make the "
            f"model's input length a multiple of {2 * cp} (e.g. the datamodule's seq_len) or change the CP size."
        )


def chunk_indices(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp``) rank ``rank`` holds, early one first.

    Example::

        chunk_indices(4, 1)  # (1, 6)
    """
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions (ascending, 1-D) of the tokens rank ``rank`` of ``cp`` holds.

    Example::

        zigzag_positions(8, 2, 0)  # tensor([0, 1, 6, 7])
    """
    check_sequence_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    parts = [torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in chunk_indices(cp, rank)]
    return torch.cat(parts)


def gathered_to_global(seq_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices that reorder the concatenation of every rank's shard (rank 0's first) into global order."""
    order = torch.cat([zigzag_positions(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(order)
