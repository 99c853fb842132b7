"""A Llama-style decoder-only transformer in plain PyTorch.

RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention`` and a SwiGLU MLP, with optional tied embeddings.
It knows nothing about parallelism: the strategies shard it from the outside.
Two choices keep it friendly to that:

* attention reshapes with ``-1`` heads, so after tensor parallelism splits the
  q/k/v projections column-wise each rank simply sees its local heads;
* rotary tables are computed in ``forward`` (a few kFLOPs) instead of being stored
  as buffers, so a model built on the meta device needs no buffer re-initialisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.data.packing import document_causal_mask
from lightning_llm.models.moe import EXPERTS_IMPLEMENTATIONS, MoEFeedForward, Router
from lightning_llm.validation import check_bool, check_choice, check_float, check_int


@dataclass
class LlamaConfig:
    """Shape of a :class:`Llama` model.

    Example::

        config = LlamaConfig.from_name("tiny", n_layers=4)
        model = Llama(config)
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden_dim: int | None = None
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Mixture of experts (lightning_llm.models.moe): with n_experts > 0 every block from n_dense_layers on routes each
    # token to top_k of n_experts SwiGLU experts of width moe_hidden_dim (default ffn_hidden_dim), plus
    # n_shared_experts always-on ones; moe_aux_loss_coef > 0 adds the load-balancing loss to the training loss.
    n_experts: int = 0
    top_k: int = 2
    moe_hidden_dim: int | None = None
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    moe_aux_loss_coef: float = 0.0
    # > 0: DeepSeek-V3's auxiliary-loss-free balancing instead (or as well): a per-expert bias on the router's scores
    # for choosing the top-k, moved by this rate toward the mean load after every optimizer step (DeepSeek: 0.001).
    moe_bias_update_rate: float = 0.0
    # How the experts run: "grouped_mm" (two torch._grouped_mm calls, models/grouped_experts.py), "loop" (one matmul
    # pair per routed expert), or "auto": grouped where it runs (CUDA bf16 with 8-aligned widths), else the loop.
    moe_implementation: str = "auto"

    def __post_init__(self) -> None:
        self._check_types()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden_dim is None:
            # Llama's recipe: 2/3 of 4*dim (SwiGLU has three matrices), rounded up to a multiple of 64.
            hidden = int(2 * 4 * self.dim / 3)
            self.ffn_hidden_dim = 64 * math.ceil(hidden / 64)
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} (dim={self.dim} / n_heads={self.n_heads}) is odd; rotary embeddings rotate "
                "channel pairs, so choose dim and n_heads with an even dim // n_heads."
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}.")
        if self.moe_hidden_dim is None:
            self.moe_hidden_dim = self.ffn_hidden_dim
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}.")

    def _check_types(self) -> None:
        """Every field's type and range, naming the field (a string "2" from a hand-written dict would otherwise
        fail as a TypeError deep in the first matmul, a negative width as an empty tensor)."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "top_k"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("n_kv_heads", "ffn_hidden_dim", "moe_hidden_dim"):
            check_int(name, getattr(self, name), minimum=1, optional=True)
        for name in ("n_experts", "n_shared_experts", "n_dense_layers"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("rope_theta", "norm_eps"):
            check_float(name, getattr(self, name), minimum=0, inclusive=False)
        for name in ("init_std", "moe_aux_loss_coef", "moe_bias_update_rate"):
            check_float(name, getattr(self, name), minimum=0)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_choice("moe_implementation", self.moe_implementation, EXPERTS_IMPLEMENTATIONS)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> LlamaConfig:
        """A preset by name (see :data:`lightning_llm.models.presets.PRESETS`), with fields overridden by keyword."""
        from lightning_llm.models.presets import PRESETS  # the presets are LlamaConfigs: imported once both exist

        if name not in PRESETS:
            raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
        return replace(PRESETS[name], **overrides)


# Checkpoints store the config in their hyperparameters; allow torch.load(weights_only=True) to read it.
torch.serialization.add_safe_globals([LlamaConfig])


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shaped (seq_len, head_dim // 2), or (batch, seq_len, head_dim // 2) at
    explicit ``positions`` (batch, seq_len) (a shard of a longer sequence under context parallelism)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    angles = positions.to(device=device, dtype=torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by pairs of interleaved channels, in fp32."""
    x_pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = x_pairs.unbind(-1)
    cos, sin = cos[..., None, :], sin[..., None, :]  # (seq, 1, d/2) or per sample (batch, seq, 1, d/2)
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.n_rep = config.n_heads // config.n_kv_heads
        self.q_proj = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # A mask (block-diagonal causal, from document ids) replaces the plain causal rule.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_rep > 1)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def feed_forward(config: LlamaConfig, layer: int) -> nn.Module:
    """Block ``layer``'s MLP: dense SwiGLU, or mixture of experts from ``n_dense_layers`` on when ``n_experts``."""
    if not config.n_experts or layer < config.n_dense_layers:
        return FeedForward(config.dim, config.ffn_hidden_dim)
    shared = (
        FeedForward(config.dim, config.n_shared_experts * config.moe_hidden_dim) if config.n_shared_experts else None
    )
    return MoEFeedForward(
        config.dim,
        config.moe_hidden_dim,
        config.n_experts,
        config.top_k,
        config.moe_aux_loss_coef,
        shared,
        bias_update_rate=config.moe_bias_update_rate,
        layer=layer,
        implementation=config.moe_implementation,
    )


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = feed_forward(config, layer)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    Example::

        model = Llama(LlamaConfig.from_name("tiny"))
        logits = model(torch.randint(0, 256, (2, 16)))
        with torch.device("meta"):  # a 7B definition, nothing allocated
            big = Llama(LlamaConfig.from_name("7B"))
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, std), residual output projections scaled by 1/sqrt(2 * n_layers).

        The scaling keeps the residual stream's variance independent of depth.
        """
        std = self.config.init_std
        for name, param in self.named_parameters():
            if param.dim() < 2:
                nn.init.ones_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                nn.init.normal_(param, std=std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(param, std=std)
        for module in self.modules():
            if isinstance(module, Router):
                module.reset_balance()

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits; with ``document_ids`` (batch, seq) a token attends only to earlier tokens of its own document.

        ``position_ids`` (batch, seq), default ``0..seq-1``, are the tokens' positions for the rotary embedding.
        ``return_hidden``: the final norm's output (batch, seq, dim) instead, for a loss that applies the head
        itself without whole logits (:func:`~lightning_llm.models.cross_entropy.head_cross_entropy`).
        """
        h = self.tok_embeddings(tokens)
        cos, sin = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta, h.device, position_ids)
        mask = None if document_ids is None else document_causal_mask(document_ids)
        for layer in self.layers:
            # The three-argument call stays as it was without document ids (pipeline stages and wrappers see it).
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask)
        h = self.norm(h)
        return h if return_hidden else self.output(h)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; with ``exclude_embeddings`` the input embedding table is left out (as in 6N FLOPs)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.config.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total
