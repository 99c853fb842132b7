"""The reference model's mixture-of-experts feed-forward: a top-k router, stacked SwiGLU experts, shared experts.

The experts keep Hugging Face transformers 5's layout (``num_experts``; ``gate_up_proj`` experts x 2I x D and
``down_proj`` experts x D x I; ``forward(hidden_states, top_k_index, top_k_weights)``), so expert parallelism,
tensor parallelism's "experts" style, the planner and the FLOP count find them by structure as they find
Mixtral's or Qwen3-MoE's. Routing follows Mixtral/Qwen3-MoE: softmax over the router logits, top-k, the k weights
renormalized. Load balancing is optional: Switch Transformer's auxiliary loss ``E * sum_i f_i * P_i`` (f the
fraction of routes to expert i, P its mean router probability), computed on the micro-batch each process sees and
kept in :attr:`MoEFeedForward.aux_loss` for the training step to add (:class:`~lightning_llm.models.CausalLM` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs stacked in two 3-D weights; runs each route on its expert.

    ``top_k_index`` holds expert ids local to this module's weights: under expert or tensor parallelism the
    weights hold only this rank's experts and the parallel style translates the ids; an id past the local
    experts (tensor parallelism's off-rank sentinel) selects nothing.

    Example::

        experts = Experts(num_experts=4, dim=32, hidden_dim=64)
        out = experts(torch.randn(10, 32), torch.randint(0, 4, (10, 2)), torch.rand(10, 2))
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        routes = top_k_index.flatten()
        tokens = torch.arange(hidden_states.shape[0], device=routes.device).repeat_interleave(top_k_index.shape[1])
        weights = top_k_weights.flatten()
        # Only the experts that got a route run (one host sync); a loop of matmuls is what CPUs do best.
        for expert in torch.unique(routes).tolist():
            if expert >= self.gate_up_proj.shape[0]:
                continue
            hit = (routes == expert).nonzero().squeeze(-1)
            x = hidden_states[tokens[hit]]
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[hit, None].to(x.dtype)
            out.index_add_(0, tokens[hit], y)
        return out


class Router(nn.Module):
    """Linear scores, softmax, top-k, the k weights renormalized to sum to 1."""

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities over experts (T, E), top-k ids (T, k), their renormalized weights (T, k))."""
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        ids = torch.topk(probs, self.top_k, dim=-1).indices
        weights = probs.gather(-1, ids)
        return probs, ids, weights / weights.sum(dim=-1, keepdim=True)


class MoEFeedForward(nn.Module):
    """Routed experts plus, if given, an always-on shared expert MLP added to their output (DeepSeek's).

    Example::

        moe = MoEFeedForward(dim=32, hidden_dim=32, num_experts=4, top_k=2, aux_loss_coef=0.01)
        y = moe(torch.randn(2, 8, 32))  # moe.aux_loss: the balancing loss of this forward
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        aux_loss_coef: float = 0.0,
        shared_experts: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.router = Router(dim, num_experts, top_k)
        self.experts = Experts(num_experts, dim, hidden_dim)
        self.shared_experts = shared_experts
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2)
        probs, ids, weights = self.router(flat)
        if self.aux_loss_coef:
            fraction = torch.bincount(ids.flatten(), minlength=probs.shape[-1]).to(probs.dtype) / ids.numel()
            self.aux_loss = self.aux_loss_coef * probs.shape[-1] * (fraction * probs.mean(dim=0)).sum()
        out = self.experts(flat, ids, weights.to(flat.dtype)).view_as(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)
