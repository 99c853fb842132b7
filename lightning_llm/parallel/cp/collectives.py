"""Autograd-aware gathers of sequence shards and all-to-alls over the context-parallel group (gloo and NCCL alike).

Two gathers differ only in their backward, which follows from who uses the gathered tensor:

- **keys/values** (:func:`gather_sequence` with ``backward="sum"``): every rank's queries attend to every rank's
  keys, so a shard's gradient is the sum of what each rank's attention sends back to it (all-reduce, keep own part);
- **the model's output** (``backward="replicated"``): every CP rank computes the same loss from the same gathered
  logits, so each rank's gradient of the full output is identical and it keeps its own positions. Scaled by the CP
  size: data parallelism averages gradients over ``dp × cp`` ranks (``dp_shard_cp``), while the CP ranks' parts
  must be summed, so each part enters the average ``cp`` times larger.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from lightning_llm.parallel.cp.layout import CPGroup, gathered_to_global, zigzag_positions


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard: torch.Tensor, dim: int, cp: CPGroup, backward: str) -> torch.Tensor:
        ctx.dim, ctx.cp, ctx.backward = dim, cp, backward
        shard = shard.contiguous()
        parts = [torch.empty_like(shard) for _ in range(cp.size)]
        dist.all_gather(parts, shard, group=cp.group)
        seq_len = shard.shape[dim] * cp.size
        return torch.cat(parts, dim=dim).index_select(dim, gathered_to_global(seq_len, cp.size, shard.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp, dim = ctx.cp, ctx.dim
        if ctx.backward == "sum":
            grad = grad.contiguous()
            dist.all_reduce(grad, group=cp.group)
        local = grad.index_select(dim, zigzag_positions(grad.shape[dim], cp.size, cp.rank, grad.device))
        if ctx.backward == "replicated":
            local = local * cp.size
        return local, None, None, None


def gather_sequence(
    shard: torch.Tensor, cp: CPGroup, *, dim: int, backward: Literal["sum", "replicated"]
) -> torch.Tensor:
    """Every rank's zig-zag shard of ``shard`` along ``dim``, concatenated in global order (see the module doc).

    Example::

        k_full = gather_sequence(k_local, cp, dim=-2, backward="sum")   # (batch, heads, seq, head_dim)
    """
    return _GatherSequence.apply(shard, dim % shard.dim(), cp, backward)


class _AllToAll(torch.autograd.Function):
    """Slot ``c`` of dim 0 goes to rank ``c``; the received slot ``c`` came from rank ``c``. Its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
        ctx.cp = cp
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=cp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.cp.group)
        return out, None


def all_to_all(slots: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Send slot ``c`` of dim 0 (``cp.size`` slots) to rank ``c``; slot ``c`` of the result came from rank ``c``.

    Example::

        received = all_to_all(x.reshape(cp.size, -1, *x.shape[1:]), cp)
    """
    return _AllToAll.apply(slots, cp)
