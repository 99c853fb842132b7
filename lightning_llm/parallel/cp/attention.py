"""Attention of a rank's query shard over the whole sequence: exact, causal by global position, GQA-aware.

Each rank holds the queries, keys and values of its two zig-zag chunks (:mod:`.layout`). Keys and values of
every rank are gathered in global order (:func:`~.collectives.gather_sequence`, torchtitan's "allgather" rotation:
one collective per tensor instead of ``C - 1`` send/recv steps; with GQA the key/value heads are the small side).
Each local query chunk then attends to exactly the keys it may see: for chunk ``j`` of length ``c``, the prefix
``[0, (j + 1) c)`` with a bottom-right causal mask, so no (query, key) pair beyond the diagonal is computed and
every rank does the same work. A :class:`~.masks.VisibleKeys` rule adds a sliding window (keys before its
left edge are not gathered into the kernel call) or packed documents, by global position. The softmax of every query row runs over all its keys at once, so the result is
the single-process attention up to floating-point summation order, and autograd's SDPA backward plus the gather's
all-reduce give exact gradients.

:func:`count_queries` lets a caller see which query rows the kernel computed (the proof that rank ``r`` attends
only for its shard).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from lightning_llm.parallel.cp.collectives import gather_sequence
from lightning_llm.parallel.cp.layout import CPGroup, chunk_indices
from lightning_llm.parallel.cp.masks import VisibleKeys

# Observers of every kernel call: fn(global query positions (1-D), number of keys).
_OBSERVERS: list[Callable[[torch.Tensor, int], None]] = []


@contextmanager
def count_queries(observer: Callable[[torch.Tensor, int], None]):
    """Call ``observer(query_positions, num_keys)`` for every attention kernel call made inside the block.

    Example::

        seen = []
        with count_queries(lambda q, k: seen.append(q)):
            loss = model(tokens).sum()
    """
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def observe_queries(positions: torch.Tensor, num_keys: int) -> None:
    """Report one kernel call (its queries' global positions, its number of keys) to :func:`count_queries`."""
    for observe in _OBSERVERS:
        observe(positions, num_keys)


def _kernel(q, k, v, *, q_start: int, k_start: int, rule: VisibleKeys, scale: float | None, gqa: bool):
    """SDPA of queries at global positions ``[q_start, q_start + len)`` over keys at ``[k_start, k_start + len)``."""
    observe_queries(torch.arange(q_start, q_start + q.shape[-2]), k.shape[-2])
    q_pos = torch.arange(q_start, q_start + q.shape[-2], device=q.device)
    mask = rule.mask(q_pos, torch.arange(k_start, k_start + k.shape[-2], device=q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cp: CPGroup,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    rule: VisibleKeys | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence; tensors are (batch, heads, local_seq, head_dim).

    ``query`` may have more heads than ``key``/``value`` (grouped-query attention, a whole multiple). The local
    sequence is this rank's two zig-zag chunks in order; the output has the query's shape. ``rule``: the keys each
    query sees (:class:`~.masks.VisibleKeys`: a sliding window, packed documents); default plain ``is_causal``.

    Example::

        out = context_parallel_attention(q, k, v, CPGroup(group, 2, rank), is_causal=True)
    """
    rule = rule or VisibleKeys(is_causal)
    gqa = query.shape[-3] != key.shape[-3]
    keys = gather_sequence(key, cp, dim=-2, backward="sum")
    values = gather_sequence(value, cp, dim=-2, backward="sum")
    chunk = query.shape[-2] // 2
    outputs = []
    for half, index in enumerate(chunk_indices(cp.size, cp.rank)):
        q = query[..., half * chunk : (half + 1) * chunk, :]
        start = index * chunk
        # Only the keys some query of this chunk may see: up to the diagonal (causal), from the window's left edge.
        first, end = rule.first_key(start), start + chunk if rule.causal else keys.shape[-2]
        kv = keys[..., first:end, :], values[..., first:end, :]
        outputs.append(_kernel(q, *kv, q_start=start, k_start=first, rule=rule, scale=scale, gqa=gqa))
    return torch.cat(outputs, dim=-2)
