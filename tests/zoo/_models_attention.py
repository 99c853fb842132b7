"""Tiny Hugging Face models with attention variants, built in code (nothing downloaded), for the TP parity tests.

Importing this module adds them to :data:`tests.zoo._models.BUILDERS`, so :class:`~tests.zoo._models.ZooLM`
and :func:`tests.zoo._harness.train` build them by name. :data:`PLANS` holds the strategy's
``tensor_parallel_plan`` for the models whose fused q/k/v layout cannot be told from widths and config
(Bloom: per-head ``[q0 k0 v0 | q1 ...]``, the same width as ``[all q | all k | all v]``), and for GptOss,
whose experts stay whole (see the entry); everything else is planned by the package (plans are merged). ``ATTENTION`` names each model's attention module inside a block (for the per-rank share).
"""

from __future__ import annotations

from tests.zoo._models import _DENSE, BUILDERS, VOCAB, _hf

_COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# 16 heads: k and v are whole on every rank, 1/(H+1) of the attention; at H=4 a rank would hold 60% of it.
_DENSE_MQA = dict(_DENSE, hidden_size=64, num_attention_heads=16, num_key_value_heads=1)

ATTENTION_BUILDERS = {
    # Multi-query: one k/v head inside the fused c_attn ([q heads | k | v]).
    "gpt_bigcode_mqa": lambda: _hf(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        **_COMMON,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        multi_query=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    # Multi-query, Falcon-7B style: [q heads | k | v] in query_key_value, num_kv_heads = 1 on the module.
    "falcon_mqa": lambda: _hf(
        "FalconConfig",
        "FalconForCausalLM",
        **_COMMON,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    # Multi-query with separate projections: k_proj and v_proj one head wide (num_key_value_heads = 1).
    "llama_mqa": lambda: _hf("LlamaConfig", "LlamaForCausalLM", **_DENSE_MQA),
    # Multi-head latent attention; every layer dense (first_k_dense_replace = layers). Up-projections and the
    # output projection wide against the down-projections, as in DeepSeek-V3 (where tp2 holds 54% per rank).
    "deepseek_v3_mla": lambda: _hf(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        **_COMMON,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
    ),
    # ALiBi: the model passes one bias row per (batch, head) to every attention module.
    "bloom_alibi": lambda: _hf(
        "BloomConfig", "BloomForCausalLM", **_COMMON, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0
    ),
    # Attention sinks: self_attn.sinks, one value per head.
    "gpt_oss_sinks": lambda: _hf(
        "GptOssConfig",
        "GptOssForCausalLM",
        **_COMMON,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # Fused QKV grouped per KV head: [q q k v | q q k v] for 2 groups of 2 query heads.
    "falcon_grouped": lambda: _hf(
        "FalconConfig",
        "FalconForCausalLM",
        **_COMMON,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
}
BUILDERS.update(ATTENTION_BUILDERS)
MODELS = list(ATTENTION_BUILDERS)

ATTENTION = {
    "gpt_bigcode_mqa": "attn",
    "falcon_mqa": "self_attention",
    "llama_mqa": "self_attn",
    "deepseek_v3_mla": "self_attn",
    "bloom_alibi": "self_attention",
    "gpt_oss_sinks": "self_attn",
    "falcon_grouped": "self_attention",
}

PLANS = {
    # Merged with inference: only what neither widths, config nor the forward's use of an output tell is named.
    # (Bloom's [q0 k0 v0 | q1 ...] query_key_value is read off its view into heads: no entry.)
    # 'experts' expects forward(hidden_states, top_k_index, top_k_weights) and marks off-rank routes with the id
    # num_local_experts, which GptOss's one_hot(router_indices, num_experts) cannot take: its experts stay whole.
    "gpt_oss_sinks": {"model.model.layers.*.mlp.experts": "replicate"},
}
