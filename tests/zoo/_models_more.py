"""More Hugging Face architectures for the tensor-parallel cells, tiny configs built in code (nothing downloaded).

First run as held-out models (none of them was named while the TP plan merge, coverage check and SP part
boundaries were built); :func:`register` adds them to :data:`tests.zoo._models.BUILDERS`.
"""

from __future__ import annotations

from tests.zoo._models import _DENSE, BUILDERS, _hf

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
}
MORE_MODELS = list(MORE)


def register() -> None:
    """Make these models buildable by name through the zoo harness (``ZooLM(name)``)."""
    BUILDERS.update(MORE)
