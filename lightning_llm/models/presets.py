"""Named model shapes for :class:`~lightning_llm.models.CausalLM` (``CausalLM("7B")``, ``config: 7B`` in YAML).

Tiny ones train on a laptop CPU; the published shapes (Llama 2 7B, Llama 3 8B / 70B / 405B, DeepSeek-V3's MoE) are
for planning on the meta device (``lightning-llm plan``) and for GPU runs. Example::

    config = LlamaConfig.from_name("8B", max_seq_len=4096)
"""

from __future__ import annotations

from lightning_llm.models.llama import LlamaConfig

PRESETS: dict[str, LlamaConfig] = {
    # Trains on a laptop CPU in about a minute.
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256),
    "small": LlamaConfig(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512),
    # ~50M parameters with a 32k vocabulary.
    "50M": LlamaConfig(vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=1024),
    "125M": LlamaConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=2048),
    # Llama-3.2-1B shapes.
    "1B": LlamaConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    # Llama-2-7B shapes.
    "7B": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=11008, max_seq_len=4096),
    # Mixtures of experts: every block but the first routes to 2 of 8 experts beside one shared expert.
    "tiny-moe": LlamaConfig(
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=256,
        n_experts=4,
        moe_hidden_dim=64,
        n_shared_experts=1,
    ),
    "small-moe": LlamaConfig(
        vocab_size=256,
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        max_seq_len=512,
        n_experts=8,
        moe_hidden_dim=256,
        n_shared_experts=1,
        n_dense_layers=1,
        moe_aux_loss_coef=0.01,
    ),
    # DeepSeek-V3's MoE shapes (666B parameters, 33B active per token) with grouped-query attention in place of
    # its multi-head latent attention: 3 dense blocks, then 256 routed experts (top 8) and one shared per block.
    "671B-moe": LlamaConfig(
        vocab_size=129280,
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden_dim=18432,
        max_seq_len=4096,
        n_experts=256,
        top_k=8,
        moe_hidden_dim=2048,
        n_shared_experts=1,
        n_dense_layers=3,
        moe_aux_loss_coef=1e-4,
    ),
    # Llama-3-8B shapes.
    "8B": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # Llama-3-70B shapes.
    "70B": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # Llama-3.1-405B shapes (for planning: `lightning-llm plan`, benchmarks/published_layouts.py).
    "405B": LlamaConfig(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden_dim=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}
