"""More Hugging Face architectures for the tensor-parallel cells, tiny configs built in code (nothing downloaded).

First run as held-out models (none of them was named while the TP plan merge, coverage check and SP part
boundaries were built); :func:`register` adds them to :data:`tests.zoo._models.BUILDERS`.
"""

from __future__ import annotations

from tests.zoo._models import _DENSE, BUILDERS, VOCAB, _hf

MORE = {
    "olmoe": lambda: _hf("OlmoeConfig", "OlmoeForCausalLM", **_DENSE, num_experts=4, num_experts_per_tok=2),
    "granitemoe": lambda: _hf(
        "GraniteMoeConfig", "GraniteMoeForCausalLM", **_DENSE, num_local_experts=4, num_experts_per_tok=2
    ),
    "glm4_moe": lambda: _hf(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        **_DENSE,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "ernie45_moe": lambda: _hf(
        "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", **_DENSE, moe_num_experts=4, moe_k=2, moe_intermediate_size=32
    ),
    "starcoder2": lambda: _hf("Starcoder2Config", "Starcoder2ForCausalLM", **_DENSE),
    "stablelm": lambda: _hf("StableLmConfig", "StableLmForCausalLM", **_DENSE),
    # StableLM 2 12B's options: one LayerNorm per head for q and k (a ModuleList each), attention beside the MLP.
    "stablelm_qk_norms": lambda: stablelm_per_head_norms(),
    "phi": lambda: _hf("PhiConfig", "PhiForCausalLM", **_DENSE, resid_pdrop=0.0, embd_pdrop=0.0),
    "cohere": lambda: _hf("CohereConfig", "CohereForCausalLM", **_DENSE),
    "smollm3": lambda: _hf("SmolLM3Config", "SmolLM3ForCausalLM", **_DENSE),
    "qwen3_next": lambda: _hf(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        **dict(_DENSE, num_hidden_layers=4),
        head_dim=8,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        full_attention_interval=2,
    ),
    # Held out in a later round: its router is a Linear inside a gate module beside the experts (mlp.gate.wg).
    "hunyuan_moe": lambda: _hf(
        "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", **_DENSE, head_dim=8, num_experts=4, moe_topk=2
    ),
    # Mamba-2 mixers (beside attention; within each block beside attention for Falcon-H1): kept whole on every
    # rank without a plan entry, found by their depthwise convolution, and reported as replicated.
    "bamba": lambda: _hf(
        "BambaConfig",
        "BambaForCausalLM",
        **_DENSE,
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        attn_layer_indices=[1],
    ),
    "falcon_h1": lambda: _hf(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        **_DENSE,
        head_dim=8,
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_ssm=64,
    ),
    # Llama 4's experts run every expert on every token (scaled by the router's scores) and take the rows alone.
    "llama4": lambda: _hf(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        **dict(_DENSE, intermediate_size=32),
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=64,
        interleave_moe_layer_step=1,
    ),
    # A fused projection of no known layout, read off the forward's use of its output: MPT's Wqkv is [q | k | v],
    # cut by chunk(3). (Bloom's, each head's q, k, v together, is read off its view into heads: attention zoo.)
    "mpt": lambda: _hf(
        "MptConfig", "MptForCausalLM", vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64
    ),
}
MORE_MODELS = list(MORE)
# Held out in a later round (benchmarks/architecture_sweep.py), under the layouts it needed a change for: ModernBERT's
# decoder cuts its MLP's `Wi` into [input | gate] with `chunk` (split per part, read off the forward) and normalizes
# its embeddings before the blocks (kept on the first pipeline stage, read off the call order).
HELD_OUT = {
    "modernbert_decoder": lambda: _hf(
        "ModernBertDecoderConfig",
        "ModernBertDecoderForCausalLM",
        **_DENSE,
        cls_token_id=1,
        sep_token_id=2,
    ),
    # Learned positions in an nn.Embedding subclass whose forward takes the attention mask. No key bias: its true
    # gradient is zero (softmax ignores a constant added to every key's score), so Adam would step on rounding noise.
    "opt": lambda: _hf(
        "OPTConfig", "OPTForCausalLM", **_DENSE, ffn_dim=64, dropout=0.0, layerdrop=0.0, enable_bias=False
    ),
    # Mamba-2 and attention layers, each with routed experts beside a shared MLP whose input_linear is [gate | up]
    "granitemoehybrid": lambda: _hf(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        **_DENSE,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=48,
        layer_types=["mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
    ),
}


def stablelm_per_head_norms():
    """StableLM with per-head q/k LayerNorms whose weights differ per head (a norm on the wrong head shows at once)."""
    import torch

    model = _hf("StableLmConfig", "StableLmForCausalLM", **_DENSE, qk_layernorm=True, use_parallel_residual=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm.norms." in name:
                param.uniform_(0.5, 1.5)
    return model


def register() -> None:
    """Make these models buildable by name through the zoo harness (``ZooLM(name)``)."""
    BUILDERS.update(MORE)
    BUILDERS.update(HELD_OUT)
