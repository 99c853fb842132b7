"""Hybrid models for the zoo: blocks of different kinds in one stack, built in code (nothing downloaded).

* ``jamba``: Hugging Face Jamba, Mamba blocks (with MoE feed-forwards) and attention blocks (dense), two
  block classes in ``model.layers``; the Mamba mixer runs its PyTorch path on CPU.
* ``deepseek_v3``: Hugging Face DeepSeek-V3, one block class whose first block is dense and the rest MoE
  (``first_k_dense_replace``), with multi-head latent attention.
* ``user_sequential``: a user's model whose blocks (attention and a causal convolution mixer) sit in an
  ``nn.Sequential`` the forward calls.
* ``reference_moe``: this package's own :class:`~lightning_llm.models.Llama` with mixture-of-experts blocks after
  a dense first one (4 experts, top 2, one shared expert).

:func:`register` adds them to :data:`tests.zoo._models.BUILDERS`, so the zoo harness
(``ZooLM(name)``, ``train``, ``train_zoo``) trains them like any zoo model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.zoo._models import _DENSE, BUILDERS, VOCAB, _hf

_HYBRID = dict(_DENSE, num_hidden_layers=4)


class _Attention(nn.Module):
    """Pre-norm causal self-attention with an MLP: the attention kind of block."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm, self.q_proj, self.kv_proj = nn.LayerNorm(width), nn.Linear(width, width), nn.Linear(width, 2 * width)
        self.o_proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
        k, v = self.kv_proj(h).chunk(2, dim=-1)
        out = F.scaled_dot_product_attention(split(self.q_proj(h)), split(k), split(v), is_causal=True)
        x = x + self.o_proj(out.transpose(1, 2).flatten(-2))
        return x + self.mlp(x)


class _ConvMixer(nn.Module):
    """A gated causal depthwise convolution (LFM2's short conv, Mamba's conv stage): the recurrent kind."""

    def __init__(self, width: int = 32, kernel: int = 4) -> None:
        super().__init__()
        self.norm, self.in_proj = nn.LayerNorm(width), nn.Linear(width, 2 * width)
        self.conv = nn.Conv1d(width, width, kernel, groups=width, padding=kernel - 1)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, h = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        h = self.conv(h.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.out_proj(F.silu(gate) * h)


class SequentialHybrid(nn.Module):
    """Embedding, an ``nn.Sequential`` of conv, attention, conv, attention blocks, norm and head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.Sequential(_ConvMixer(width), _Attention(width), _ConvMixer(width), _Attention(width))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(ids))))


def _user_sequential() -> SequentialHybrid:
    torch.manual_seed(0)
    return SequentialHybrid()


HYBRID = {
    "jamba": lambda: _hf(
        "JambaConfig",
        "JambaForCausalLM",
        **_HYBRID,
        attn_layer_period=2,
        attn_layer_offset=1,  # blocks 1, 3 attention; 0, 2 Mamba
        expert_layer_period=2,
        expert_layer_offset=0,  # blocks 0, 2 MoE; 1, 3 dense
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
    "deepseek_v3": lambda: _hf(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        **dict(_HYBRID, num_key_value_heads=4),
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,  # block 0 dense, blocks 1-3 MoE
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    ),
    "user_sequential": _user_sequential,
}
HYBRID_MODELS = list(HYBRID)


def _reference_moe() -> nn.Module:
    from lightning_llm.models import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64, n_experts=4, top_k=2,
        moe_hidden_dim=16, n_shared_experts=1, n_dense_layers=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return Llama(config)


def register() -> None:
    """Make the hybrid models and the reference MoE buildable by name through the zoo harness (``ZooLM(name)``)."""
    BUILDERS.update(HYBRID, reference_moe=_reference_moe)
