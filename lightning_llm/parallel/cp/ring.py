"""Ring attention with send/recv: key/value shards travel around the CP group, partial outputs merged by LSE.

The alternative to :mod:`.attention`'s all-gather. At step ``s`` of ``C`` each rank holds the key/value shard of
rank ``r - s`` (it arrived from the previous rank while the last step computed) and attends its two query chunks
to the key chunks it may see: earlier chunks whole, its own chunk with the causal diagonal, later chunks not at
all. Partial outputs are merged exactly with their log-sum-exp (``out = Σ exp(lse_i - lse) out_i``, ``lse =
logsumexp_i lse_i``), as flash attention merges key tiles. No rank ever holds more than two shards of keys/values.

The backward (an ``autograd.Function``) walks the ring again: each key block's gradient is recomputed by the flash
kernel's backward from the *merged* output and log-sum-exp (which makes each block's share exact), and the block's
dk/dv travel with it, so after ``C`` hops every rank holds the full gradient of its own keys/values. The blocks run
SDPA's own kernels (CPU flash; CUDA flash for fp16/bf16, memory-efficient for fp32), which return the log-sum-exp;
GQA with the key/value heads as they are where the kernel takes them grouped (CPU flash, CUDA flash), else
repeated to the query heads per block (CUDA's memory-efficient kernel). Those kernels need one head size for
queries, keys and values; latent attention (DeepSeek's MLA: value heads narrower than query/key heads) is run with
the narrower side zero-padded, which changes no score and no output column that is kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_llm._compat.torch_kernels import attention_with_lse, attention_with_lse_backward, takes_grouped_heads
from lightning_llm.parallel.cp.attention import observe_queries
from lightning_llm.parallel.cp.layout import CPGroup, chunk_indices


def _rotate(tensors: list[torch.Tensor], cp: CPGroup) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's."""
    if cp.size == 1:
        return tensors
    to = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size) if cp.group is not None else (cp.rank + 1) % cp.size
    frm = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size) if cp.group is not None else (cp.rank - 1) % cp.size
    tensors = [t.contiguous() for t in tensors]  # gloo sends and receives contiguous buffers only
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to, cp.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, frm, cp.group) for t in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _pairs(cp: CPGroup, source: int, causal: bool):
    """(query half, key half, causal diagonal?) pairs this rank computes against ``source``'s key/value shard."""
    for qh, qi in enumerate(chunk_indices(cp.size, cp.rank)):
        for kh, ki in enumerate(chunk_indices(cp.size, source)):
            if not causal or ki < qi:
                yield qh, kh, False
            elif ki == qi:
                yield qh, kh, True


def _half(t: torch.Tensor, h: int) -> torch.Tensor:
    c = t.shape[-2] // 2
    return t[..., h * c : (h + 1) * c, :]


def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    """How many times the kernel needs each key/value head repeated: ``1`` where it takes them grouped."""
    return 1 if takes_grouped_heads(q) else q.shape[-3] // k.shape[-3]


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_repeat`: the repeated heads' gradients summed."""
    return t.unflatten(-3, (-1, groups)).sum(-3)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: CPGroup, causal: bool, scale: float | None):
        groups, acc = _groups(q, k), torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = [k, v]
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            nxt = _rotate(kv, cp) if step < cp.size - 1 else None  # posted before computing (gloo runs it anyway)
            ks, vs = (_repeat(t, groups) for t in kv)
            for qh, kh, diagonal in _pairs(cp, source, causal):
                part, part_lse, ctx.kernel = attention_with_lse(
                    _half(q, qh), _half(ks, kh), _half(vs, kh), is_causal=diagonal, scale=scale
                )  # fmt: skip
                c = q.shape[-2] // 2
                rows = slice(qh * c, (qh + 1) * c)
                start = chunk_indices(cp.size, cp.rank)[qh] * c
                observe_queries(torch.arange(start, start + c), c)
                merged = torch.logaddexp(lse[..., rows], part_lse)
                out[..., rows, :] = (
                    out[..., rows, :] * torch.exp(lse[..., rows] - merged)[..., None]
                    + part.to(acc) * torch.exp(part_lse - merged)[..., None]
                )
                lse[..., rows] = merged
            kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.scale = cp, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, scale = ctx.cp, ctx.causal, ctx.scale
        groups, acc = _groups(q, k), torch.promote_types(q.dtype, torch.float32)
        c = q.shape[-2] // 2
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        held = [
            k,
            v,
            torch.zeros(k.shape, dtype=acc, device=k.device),
            torch.zeros(v.shape, dtype=acc, device=v.device),
        ]
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            ks, vs = (_repeat(t, groups) for t in held[:2])
            # Gradients of grouped heads go straight into the travelling ones; repeated heads' are summed after.
            grads = held[2:] if groups == 1 else [torch.zeros_like(t, dtype=acc) for t in (ks, vs)]
            for qh, kh, diagonal in _pairs(cp, source, causal):
                rows, keys = slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c)
                dqi, dki, dvi = attention_with_lse_backward(
                    grad_out[..., rows, :], q[..., rows, :], ks[..., keys, :], vs[..., keys, :], out[..., rows, :],
                    lse[..., rows], ctx.kernel, is_causal=diagonal, scale=scale,
                )  # fmt: skip
                dq[..., rows, :] += dqi
                grads[0][..., keys, :] += dki
                grads[1][..., keys, :] += dvi
            if groups > 1:
                held[2] += _fold(grads[0], groups)
                held[3] += _fold(grads[1], groups)
            held = _rotate(held, cp) if step < cp.size - 1 else [*held[:2], *_rotate(held[2:], cp)]
        return dq.to(q.dtype), held[-2].to(k.dtype), held[-1].to(v.dtype), None, None, None


def ring_attention(
    query: Tensor, key: Tensor, value: Tensor, cp: CPGroup, *, is_causal: bool = True, scale: float | None = None
) -> Tensor:
    """Like :func:`~.attention.context_parallel_attention`, with key/value shards passed around the ring.

    Example::

        out = ring_attention(q, k, v, CPGroup(group, 2, rank), is_causal=True)
    """
    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if qk_dim == v_dim:
        return _RingAttention.apply(query, key, value, cp, is_causal, scale)
    # Zero columns added to queries and keys leave every score as it was (the scale stays the unpadded one);
    # zero columns added to values come out as zero output columns, cut off again.
    width = max(qk_dim, v_dim)
    scale = qk_dim**-0.5 if scale is None else scale
    query, key = (F.pad(t, (0, width - qk_dim)) for t in (query, key))
    out = _RingAttention.apply(query, key, F.pad(value, (0, width - v_dim)), cp, is_causal, scale)
    return out[..., :v_dim]
