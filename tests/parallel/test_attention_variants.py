"""Attention variants recognised from config and module structure (never class names), and refused first.

The parity of each variant under tp2 / tp2+SP is in tests/zoo/test_attention_variants.py; here the plan
entries, the refusals and the multi-query all-to-all are checked on one process.
"""

from __future__ import annotations

import pytest

import tests.zoo._models_attention  # noqa: F401  (registers the builders)
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.parallel.parallelize import plan_tensor_parallel
from lightning_llm.parallel.tp.attention_variants import attention_plan, model_config, recognise
from lightning_llm.parallel.tp.fused import regroup_exchange, shared_parts
from tests.zoo._models import ZooLM, _hf

pytestmark = pytest.mark.timeout(120)

EXPECTED = {
    "gpt_bigcode_mqa": {"attn.c_attn": "fused_colwise:32,*8,*8", "attn.c_proj": "rowwise"},
    "deepseek_v3_mla": {
        "self_attn.q_a_proj": "replicate_shared:0",
        "self_attn.q_a_layernorm": "replicate",
        "self_attn.q_b_proj": "colwise_replicated_input",
        "self_attn.kv_a_proj_with_mqa": "replicate_shared:4",
        "self_attn.kv_a_layernorm": "replicate",
        "self_attn.kv_b_proj": "colwise_replicated_input",
        "self_attn.o_proj": "rowwise",
    },
    "llama_mqa": {"self_attn.k_proj": "replicate_shared", "self_attn.v_proj": "replicate_shared"},
    "falcon_grouped": {"self_attention.query_key_value": "colwise", "self_attention.dense": "rowwise"},
    "gpt_oss_sinks": {},  # plain GQA projections; the sinks follow the heads when the plan is applied
    "bloom_alibi": {},  # [q0 k0 v0 | ...] and [q | k | v] have the same width: left to the plan rules
}


def _block(name: str):
    module = ZooLM(name)
    blocks_name, blocks = find_blocks(module, None)
    return module, blocks_name, blocks


@pytest.mark.parametrize("name", list(EXPECTED))
def test_attention_plan_recognises_the_variant(name):
    module, _, blocks = _block(name)
    assert attention_plan(blocks[0], model_config(module)) == EXPECTED[name]


@pytest.mark.parametrize("name", ["gpt_bigcode_mqa", "deepseek_v3_mla", "falcon_grouped"])
def test_recognition_ignores_class_names(name):
    """The same module under another class name gets the same plan: nothing is keyed by model or class names."""
    module, _, blocks = _block(name)
    for child in blocks[0].modules():
        child.__class__ = type(f"Renamed{id(child)}", (type(child),), {})
    assert attention_plan(blocks[0], model_config(module)) == EXPECTED[name]


def test_falcon_7b_style_multi_query_is_recognised():
    model = _hf(
        "FalconConfig", "FalconForCausalLM", vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=8
    )
    attention = model.transformer.h[0].self_attention
    variant = recognise(attention)
    assert variant.kind == "mqa"
    assert variant.entries == {"query_key_value": "fused_colwise:32,*4,*4", "dense": "rowwise"}


@pytest.mark.parametrize(
    "name, says",
    [
        ("gpt_bigcode_mqa", "multi-query"),
        ("deepseek_v3_mla", "latent"),
        ("bloom_alibi", "ALiBi"),
        ("gpt_oss_sinks", "per-head parameters"),
    ],
)
def test_indivisible_heads_are_refused_first_with_the_ways_out(name, says):
    module, blocks_name, blocks = _block(name)
    with pytest.raises(ValueError, match=says) as error:
        plan_tensor_parallel(module, tp=3, blocks_name=blocks_name, blocks=blocks, user_plan=None)
    message = str(error.value)
    assert "tensor_parallel_size=3" in message and "pipeline_parallel_size" in message and "zero_stage" in message
    assert "fused projection" not in message


def test_multi_query_is_planned_not_refused_at_tp2():
    module, blocks_name, blocks = _block("gpt_bigcode_mqa")
    plan, source = plan_tensor_parallel(module, tp=2, blocks_name=blocks_name, blocks=blocks, user_plan=None)
    assert source == "attention variants + inferred"
    assert plan["model.transformer.h.*.attn.c_attn"] == "fused_colwise:32,*8,*8"


def test_shared_parts_reach_every_rank_whole():
    """[q (32) | k (8) | v (8)] over 2 ranks: each gets its 16 q columns and all 16 k/v columns, in order."""
    assert shared_parts("fused_colwise:32,*8,*8") == (False, True, True)
    assert shared_parts("fused_colwise:2") == (False, False)
    received = {}
    for rank in range(2):
        send, input_splits, _ = regroup_exchange((32, 8, 8), 2, rank, (False, True, True))
        offset = 0
        for dest, count in enumerate(input_splits):  # local column c of rank r is global column r*24 + c
            received.setdefault(dest, {})[rank] = [rank * 24 + c for c in send[offset : offset + count]]
            offset += count
    for dest in range(2):
        columns = received[dest][0] + received[dest][1]
        assert columns == [*range(16 * dest, 16 * dest + 16), *range(32, 48)]
