"""Token dispatch and combine for expert parallelism: routes sorted by expert, moved by all-to-all, and back.

Every EP rank holds different tokens and a contiguous block of whole experts. Each route (a token and one of its
top-k experts) is one row: the rows are sorted by expert, so the rows for EP rank ``r``'s experts are one contiguous
chunk, and one ``all_to_all_single`` with variable splits sends every chunk to its owner (dropless: no capacity, no
padding). The owner first learns how many rows it receives for each of its experts from a small all-to-all of
counts, which also tells it each received row's local expert. After the experts ran, the inverse all-to-all brings
every row home, the rows are put back in route order, weighted by the router's scores and summed over the top-k.

The data all-to-alls are autograd-aware (their backward is the reverse all-to-all), so the gradient of a remote
route's output flows back to the rank that sent the token, and the expert weights' gradient sums the contributions
of every EP rank's tokens. The router's scores never leave their rank: they are applied after combining, so the
router's gradient is computed where the router lives, as in the single process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_llm._compat.torch_distributed import all_to_all_single


@dataclass
class Routing:
    """What :func:`combine` needs from :func:`dispatch`: the sort order and the all-to-all splits of one call."""

    order: torch.Tensor  # route index (token * top_k + k) of each sorted row
    input_splits: list[int]  # rows sent to each EP rank
    output_splits: list[int]  # rows received from each EP rank
    top_k: int


def dispatch(
    hidden: torch.Tensor, index: torch.Tensor, mesh: DeviceMesh, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Send each route's token to the EP rank owning its expert.

    Args:
        hidden: ``(tokens, dim)`` this rank's tokens.
        index: ``(tokens, top_k)`` global expert ids chosen by the router.
        mesh: the 1-D EP mesh; rank ``r`` owns experts ``[r * local, (r + 1) * local)``.
        num_experts: experts of the whole layer.

    Returns:
        ``(rows, local_ids, routing)``: the rows this rank's experts must process (grouped by source rank, then by
        expert), each row's local expert id, and what :func:`combine` needs.

    Example::

        rows, ids, routing = dispatch(hidden, top_k_index, ep_mesh, num_experts=8)
        out = combine(run_local_experts(rows, ids), top_k_weights, routing, ep_mesh)
    """
    ep = mesh.size()
    local = num_experts // ep
    top_k = index.shape[-1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sent_counts = torch.bincount(flat, minlength=num_experts)
    received_counts = torch.empty_like(sent_counts)
    # Each rank sends the counts of rank r's experts to rank r (equal splits of `local` counts each).
    dist.all_to_all_single(received_counts, sent_counts, group=mesh.get_group())
    input_splits = sent_counts.view(ep, local).sum(1).tolist()
    output_splits = received_counts.view(ep, local).sum(1).tolist()
    rows = hidden[order // top_k]
    received = all_to_all_single(rows, output_splits, input_splits, mesh)
    # Rows from each source rank arrive sorted by expert: source-major, then local expert.
    local_ids = torch.arange(local, device=hidden.device).repeat(ep).repeat_interleave(received_counts)
    return received, local_ids, Routing(order, input_splits, output_splits, top_k)


def combine(
    expert_out: torch.Tensor, weights: torch.Tensor, routing: Routing, mesh: DeviceMesh, dtype: torch.dtype
) -> torch.Tensor:
    """Bring the experts' outputs home, back in route order, weighted by the router's scores and summed over top-k.

    ``expert_out`` is ``(received rows, dim)`` in :func:`dispatch`'s row order; ``weights`` is ``(tokens, top_k)``.
    Returns ``(tokens, dim)`` in ``dtype``.
    """
    back = all_to_all_single(expert_out, routing.input_splits, routing.output_splits, mesh)
    routes = back[torch.argsort(routing.order)]
    tokens, dim = weights.shape[0], expert_out.shape[-1]
    weighted = routes.view(tokens, routing.top_k, dim) * weights.unsqueeze(-1)
    return weighted.sum(1).to(dtype)
