"""Private torch kernels: SDPA's kernels that return the log-sum-exp (and their backward), for ring attention, and
``torch._grouped_mm``, every expert's matmul in one kernel."""

from __future__ import annotations

import torch

from lightning_llm._compat.registry import Private, register

CHECKED = "torch 2.13.0"


def _cuda_flash(query: torch.Tensor) -> bool:
    """Whether CUDA's flash kernel runs ``query`` (fp16/bf16, head dim up to 256); else memory-efficient attention."""
    return query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """SDPA's own kernel for the device, returning (output, logsumexp, what the same kernel's backward needs).

    The log-sum-exp of every query row is what merges partial attentions over key blocks exactly (ring attention);
    public ``scaled_dot_product_attention`` does not return it. CPU: the flash kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``); CUDA: the flash kernel for fp16/bf16 with head dim up
    to 256, memory-efficient attention otherwise (fp32), as torch's own ``context_parallel`` dispatches.
    (batch, heads, seq, head_dim) in; logsumexp is (batch, heads, seq) in fp32. Checked on torch 2.13.0 (CPU) and
    torch 2.11 (CUDA, ``tests/gpu/test_ring_kernels.py``).
    """
    aten = torch.ops.aten
    if query.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=None, scale=scale
        )
        return out, lse, ()
    if _cuda_flash(query):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, is_causal, False, scale=scale
        )
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, is_causal, scale=scale
    )  # the log-sum-exp comes padded to a multiple of 32 rows: cut here, padded again for the backward
    return out, lse[..., : query.shape[-2]], ("efficient", lse.shape[-1], seed, offset)


def takes_grouped_heads(query: torch.Tensor) -> bool:
    """Whether :func:`attention_with_lse`'s kernel for ``query`` takes keys and values with fewer heads than the
    queries (grouped-query attention) as they are: CPU's flash kernel and CUDA's flash kernel do (they are what
    ``scaled_dot_product_attention(enable_gqa=True)`` calls with unrepeated keys and values), the memory-efficient
    kernel does not (SDPA repeats the heads for it). Checked on torch 2.13.0 (CPU, forward and backward)."""
    return query.device.type == "cpu" or _cuda_flash(query)


def attention_with_lse_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    state: tuple,
    *,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one key block given the merged output and log-sum-exp of the whole row (so each block's
    share of the gradient is exact), by the backward of the kernel :func:`attention_with_lse` chose; ``state`` is
    its third return value for a block of the same shapes."""
    aten = torch.ops.aten
    grad_out, query, key, value, out = (t.contiguous() for t in (grad_out, query, key, value, out))
    logsumexp = logsumexp.contiguous()
    if not state:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=None, scale=scale
        )
    if state[0] == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = state
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, logsumexp, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset,
            scale=scale,
        )[:3]  # fmt: skip
    _, width, seed, offset = state
    logsumexp = torch.nn.functional.pad(logsumexp, (0, width - logsumexp.shape[-1]))
    return aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, None, out, logsumexp, seed, offset, 0.0, (True, True, True, False), is_causal,
        scale=scale,
    )[:3]  # fmt: skip


register(
    Private(
        name="aten._scaled_dot_product_{flash_attention_for_cpu,flash_attention,efficient_attention} (+ _backward)",
        upstream="torch",
        accessor="torch_kernels.attention_with_lse, torch_kernels.attention_with_lse_backward, "
        "torch_kernels.takes_grouped_heads",
        used_by=("parallel/cp/ring.py",),
        why="ring attention merges partial attentions over key blocks with each row's log-sum-exp and recomputes "
        "each block's gradient from the merged output; SDPA's kernels return the log-sum-exp, the public SDPA does "
        "not (the flash kernels also take grouped key/value heads as they are)",
        caught_by="`tests/parallel/test_context_parallel.py`, `tests/gpu/test_ring_kernels.py`",
        checked=CHECKED,
        check=lambda: (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
            torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
        ),
    )
)


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (2.8 and later). Checked on torch 2.13.0 and 2.11 (CPU)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: rows ``offs[i-1]:offs[i]`` of the 2-D ``a`` times the 3-D ``b[i]``,
    every group in one kernel, differentiable. Checked on torch 2.13.0 and 2.11 (CPU, fp32)."""
    return torch._grouped_mm(a, b, offs=offs)


register(
    Private(
        name="torch._grouped_mm",
        upstream="torch",
        accessor="torch_kernels.grouped_mm, torch_kernels.has_grouped_mm",
        used_by=("models/grouped_experts.py",),
        why="every expert's matmul in one kernel on its own rows (the grouped GEMM torchtitan and Hugging Face's "
        "`grouped_mm` experts use); no public grouped matmul exists",
        caught_by="`tests/models/test_grouped_experts.py`, `tests/gpu/test_cuda_paths.py`",
        checked=CHECKED,
        check=lambda: torch._grouped_mm,
    )
)
