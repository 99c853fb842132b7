"""Ulysses attention: all-to-all from sequence-sharded to head-sharded around attention, and back.

DeepSpeed-Ulysses' trade: before attention each rank sends every other rank the heads it will own, for its own
tokens, and receives that rank's tokens for its own heads; it then holds the *whole* sequence for ``H / C`` heads and
runs ordinary (causal) attention with any kernel, and a second all-to-all returns the output to sequence shards.
Communication is ``4 / C`` of the activations per layer (vs. the ring's ``C - 1`` key/value hops), but the head
counts must divide by ``C`` (times ``tp``): query heads always, key/value heads or they are repeated up to the query
heads (exact, costs their memory). The zig-zag shard order (:mod:`.layout`) is undone after the first all-to-all and
redone before the second, so the attention itself sees tokens in global order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llm.parallel.cp.attention import observe_queries
from lightning_llm.parallel.cp.collectives import all_to_all
from lightning_llm.parallel.cp.layout import CPGroup, gathered_to_global


def _to_heads(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """(batch, heads, seq / C, dim) zig-zag shard -> (batch, heads / C, seq, dim) in global order."""
    b, h, n, d = x.shape
    slots = x.reshape(b, cp.size, h // cp.size, n, d).transpose(0, 1).contiguous()
    received = all_to_all(slots, cp)  # slot c: rank c's tokens, for this rank's heads
    full = received.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * n, d)
    return full.index_select(2, gathered_to_global(cp.size * n, cp.size, x.device))


def _to_sequence(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """(batch, heads / C, seq, dim) in global order -> (batch, heads, seq / C, dim) zig-zag shard."""
    b, hc, seq, d = x.shape
    order = torch.argsort(gathered_to_global(seq, cp.size, x.device))  # global -> ranks' shards, rank 0 first
    slots = x.index_select(2, order).reshape(b, hc, cp.size, seq // cp.size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = all_to_all(slots, cp)  # slot c: this rank's tokens, for rank c's heads
    return received.transpose(0, 1).reshape(b, cp.size * hc, seq // cp.size, d)


def check_ulysses_heads(heads: int, kv_heads: int | None, cp: int, tp: int = 1) -> None:
    """Refuse head counts Ulysses cannot split over ``cp × tp`` ranks, naming the numbers and the ring."""
    if heads % (cp * tp):
        raise ValueError(
            f"context_parallel_method='ulysses' gives each of context_parallel_size={cp} × tensor_parallel_size={tp} "
            f"= {cp * tp} ranks whole attention heads, but the model has {heads} query heads; use "
            "context_parallel_method='ring' (no head constraint) or a CP size dividing the heads."
        )


def ulysses_attention(
    query: Tensor, key: Tensor, value: Tensor, cp: CPGroup, *, is_causal: bool = True, scale: float | None = None
) -> Tensor:
    """Attention of zig-zag sequence shards through head-sharded full-sequence attention (see the module doc).

    Example::

        out = ulysses_attention(q, k, v, CPGroup(group, 2, rank))   # q: (batch, heads, seq / 2, head_dim)
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    check_ulysses_heads(heads, kv_heads, cp.size)
    if kv_heads % cp.size:  # fewer key/value heads than ranks: repeat them up to the query heads
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    q, k, v = (_to_heads(t, cp) for t in (query, key, value))
    observe_queries(torch.arange(q.shape[2]), k.shape[2])
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return _to_sequence(out, cp)
