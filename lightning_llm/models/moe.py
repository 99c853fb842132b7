"""The reference model's mixture-of-experts feed-forward: a top-k router, stacked SwiGLU experts, shared experts.

The experts keep Hugging Face transformers 5's layout (``num_experts``; ``gate_up_proj`` experts x 2I x D and
``down_proj`` experts x D x I; ``forward(hidden_states, top_k_index, top_k_weights)``), so expert parallelism,
tensor parallelism's "experts" style, the planner and the FLOP count find them by structure as they find
Mixtral's or Qwen3-MoE's. Routing follows Mixtral/Qwen3-MoE: softmax over the router logits, top-k, the k weights
renormalized. Load balancing is optional: Switch Transformer's auxiliary loss ``E * sum_i f_i * P_i`` (f the
fraction of routes to expert i, P its mean router probability), computed on the micro-batch each process sees and
kept in :attr:`MoEFeedForward.aux_loss` for the training step to add (:class:`~lightning_llm.models.CausalLM` does),
or DeepSeek-V3's auxiliary-loss-free balancing (Wang et al., 2024): a per-expert bias added to the scores only to
choose the top-k (the weights stay the unbiased probabilities), moved after every optimizer step by
``bias_update_rate`` toward the mean load: ``bias += rate * sign(mean load - load)``, the loads counted over the
whole step's global batch (:func:`update_expert_biases`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_llm._compat.torch import is_fake
from lightning_llm.models.grouped_experts import grouped_mm_supported, grouped_swiglu

EXPERTS_IMPLEMENTATIONS = ("auto", "loop", "grouped_mm")


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs stacked in two 3-D weights; runs each route on its expert.

    ``implementation``: "loop" (below), "grouped_mm" (:func:`~lightning_llm.models.grouped_experts.grouped_swiglu`)
    or "auto" (grouped on CUDA where the kernel runs, else the loop).

    ``top_k_index`` holds expert ids local to this module's weights: under expert or tensor parallelism the
    weights hold only this rank's experts and the parallel style translates the ids; an id past the local
    experts (tensor parallelism's off-rank sentinel) selects nothing.

    Example::

        experts = Experts(num_experts=4, dim=32, hidden_dim=64)
        out = experts(torch.randn(10, 32), torch.randint(0, 4, (10, 2)), torch.rand(10, 2))
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, implementation: str = "auto") -> None:
        super().__init__()
        self.num_experts, self.implementation = num_experts, implementation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        supported = grouped_mm_supported(hidden_states, self.gate_up_proj, self.down_proj)
        if self.implementation == "grouped_mm" and not supported:
            raise ValueError(
                f"moe_implementation='grouped_mm' does not run on {hidden_states.dtype} {hidden_states.device.type} "
                f"tensors with torch {torch.__version__} (CUDA needs bf16 and widths that are multiples of 8; CPU fp32). "
                "Use moe_implementation='auto' or 'loop'."
            )
        if self.implementation == "grouped_mm" or (
            self.implementation == "auto" and hidden_states.is_cuda and supported
        ):
            return grouped_swiglu(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        routes = top_k_index.flatten()
        tokens = torch.arange(hidden_states.shape[0], device=routes.device).repeat_interleave(top_k_index.shape[1])
        weights = top_k_weights.flatten()
        for expert, hit in self._routed(routes):
            x = hidden_states[tokens[hit]]
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[hit, None].to(x.dtype)
            out.index_add_(0, tokens[hit], y)
        return out

    def _routed(self, routes: torch.Tensor):
        """(expert, positions of its routes) for each local expert that got a route: one host sync; a loop of matmuls
        is what CPUs do best. On fake or meta tensors (planning memory and time before anything is allocated) the
        routes have no values: each expert takes an even share of them, as uniform routing would on average
        (``torch.compile`` traces on fake tensors too, and must keep the real routes)."""
        local = self.gate_up_proj.shape[0]
        if (is_fake(routes) or routes.is_meta) and not torch.compiler.is_compiling():
            share = -(-routes.numel() // local)
            for expert in range(local):
                yield (
                    expert,
                    torch.arange(expert * share, min((expert + 1) * share, routes.numel()), device=routes.device),
                )
            return
        for expert in torch.unique(routes).tolist():
            if expert < local:
                yield expert, (routes == expert).nonzero().squeeze(-1)


class Router(nn.Module):
    """Linear scores, softmax, top-k, the k weights renormalized to sum to 1.

    With ``bias_update_rate > 0`` the top-k is chosen on the probabilities plus the buffer ``expert_bias`` (saved
    in checkpoints, moved by :func:`update_expert_biases`), and training forwards count the routes per expert in
    ``tokens_per_expert`` (an activation-checkpointing recompute counts a layer's routes twice: the update reads
    only the sign of each expert's load against the mean, which scaling leaves unchanged).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, bias_update_rate: float = 0.0, layer: int = 0) -> None:
        super().__init__()
        self.top_k, self.bias_update_rate, self.layer = top_k, bias_update_rate, layer
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        if bias_update_rate:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def reset_balance(self) -> None:
        """Zero the bias and the counts (a fresh model, or one materialized from the meta device)."""
        if self.bias_update_rate:
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities over experts (T, E), top-k ids (T, k), their renormalized weights (T, k))."""
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        if not self.bias_update_rate:
            ids = torch.topk(probs, self.top_k, dim=-1).indices
        else:
            ids = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            if self.training and torch.is_grad_enabled():
                self.tokens_per_expert += torch.bincount(ids.flatten(), minlength=probs.shape[-1])
        weights = probs.gather(-1, ids)
        return probs, ids, weights / weights.sum(dim=-1, keepdim=True)


def update_expert_biases(model: nn.Module, num_layers: int, num_experts: int) -> None:
    """Move every bias-balanced router's ``expert_bias`` toward the mean load of the routes counted since the last
    call, then reset the counts; call it once per optimizer step on every rank.

    The counts of all ``num_layers`` layers are summed over every rank in one all-reduce (a fixed
    ``(num_layers, num_experts)`` tensor, so pipeline stages holding different layers, or none, agree on it):
    data- and context-parallel ranks route different tokens, tensor-parallel peers the same ones, which scales a
    layer's loads but not their sign against the mean. Every rank then applies the same update.

    Example::

        update_expert_biases(model, config.n_layers, config.n_experts)  # after backward, before optimizer.step()
    """
    routers = {m.layer: m for m in model.modules() if _balanced(m)}
    if not routers and not (dist.is_available() and dist.is_initialized()):
        return
    device = next(iter(routers.values())).tokens_per_expert.device if routers else _device_of(model)
    counts = torch.zeros(num_layers, num_experts, device=device)
    for layer, router in routers.items():
        counts[layer] = router.tokens_per_expert
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    for layer, router in routers.items():
        router.expert_bias += router.bias_update_rate * torch.sign(counts[layer].mean() - counts[layer])
        router.tokens_per_expert.zero_()


def _balanced(module: nn.Module) -> bool:
    return isinstance(module, Router) and bool(module.bias_update_rate)


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


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
        bias_update_rate: float = 0.0,
        layer: int = 0,
        implementation: str = "auto",
    ) -> None:
        super().__init__()
        self.router = Router(dim, num_experts, top_k, bias_update_rate, layer)
        self.experts = Experts(num_experts, dim, hidden_dim, implementation)
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
