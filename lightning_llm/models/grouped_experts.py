"""Stacked SwiGLU experts run with two grouped matrix multiplies (``torch._grouped_mm``) instead of a loop.

The loop in :class:`~lightning_llm.models.moe.Experts` runs one pair of matmuls per expert that got a route and
reads the routed experts on the host (one sync per layer): what CPUs do best, and slow on a GPU with many small
experts. Here every route is sorted by expert and each expert's rows are padded to a multiple of ``align`` rows
(the row alignment grouped GEMM kernels want; torchtitan pads the same way), in a buffer sized without reading
anything on the host (``routes + experts * align`` rows, the padding rows left zero and outside every group). One
``_grouped_mm`` computes every expert's gate/up projection, one its down projection; the rows go back to their
tokens weighted by the router's scores. torch's ``_grouped_mm`` is differentiable and also runs on CPU (fp32), so
the two paths are compared there (``tests/models/test_grouped_experts.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_llm._compat.torch_kernels import grouped_mm, has_grouped_mm

ALIGN = 16  # rows per expert group: a multiple of 8 for bf16 kernels, 16 for fp8


def grouped_mm_supported(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether the grouped path runs here: ``torch._grouped_mm`` exists, and on CUDA the inputs are bf16 with
    widths whose rows are 16-byte aligned (the kernel's requirement)."""
    if not has_grouped_mm():
        return False
    if hidden.device.type != "cuda":
        return hidden.dtype == torch.float32
    widths = (gate_up_proj.shape[-1], gate_up_proj.shape[-2] // 2, down_proj.shape[-2])
    return hidden.dtype == torch.bfloat16 and all(w % 8 == 0 for w in widths)


def grouped_swiglu(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    align: int = ALIGN,
) -> torch.Tensor:
    """``sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x))`` over each token's routes, ``e`` its k-th expert.

    Args:
        hidden_states: ``(tokens, dim)``.
        gate_up_proj: ``(experts, 2 * hidden, dim)``; ``down_proj``: ``(experts, dim, hidden)`` (Hugging Face's
            stacked layout).
        top_k_index: ``(tokens, k)`` expert ids; an id past the local experts selects nothing.
        top_k_weights: ``(tokens, k)`` the router's scores.

    Example::

        out = grouped_swiglu(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    """
    experts = gate_up_proj.shape[0]
    routes = top_k_index.flatten()
    tokens = torch.arange(hidden_states.shape[0], device=routes.device).repeat_interleave(top_k_index.shape[1])
    valid = routes < experts
    # An id past the local experts computes on expert 0 with weight 0: no boolean indexing, so no host sync.
    routes = torch.where(valid, routes, torch.zeros_like(routes))
    weights = top_k_weights.flatten() * valid
    order = torch.argsort(routes, stable=True)
    counts = torch.bincount(routes, minlength=experts)
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    # Row of each sorted route in the padded buffer: its group's start plus its rank within the group.
    sorted_routes = routes[order]
    rank_in_group = (
        torch.arange(order.numel(), device=routes.device) - (torch.cumsum(counts, 0) - counts)[sorted_routes]
    )
    rows = (ends - padded)[sorted_routes] + rank_in_group
    buffer = hidden_states.new_zeros(order.numel() + experts * align, hidden_states.shape[-1])
    buffer = buffer.index_copy(0, rows, hidden_states[tokens[order]])
    offsets = ends.to(torch.int32)
    gate, up = grouped_mm(buffer, gate_up_proj.transpose(-2, -1), offsets).chunk(2, dim=-1)
    out_rows = grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offsets)[rows]
    out_rows = out_rows * weights[order, None].to(out_rows.dtype)
    return torch.zeros_like(hidden_states).index_add(0, tokens[order], out_rows.to(hidden_states.dtype))
