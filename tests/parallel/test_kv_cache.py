"""Hugging Face KV cache under activation checkpointing: turned off for training, or refused by name."""

import copy
import logging

import pytest
import torch
import transformers

from lightning_llm.parallel.activation_checkpointing import checkpoint_block
from lightning_llm.parallel.kv_cache import disable_kv_cache


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _checkpointed(model):
    for layer in model.model.layers:
        checkpoint_block(layer)
    return model


def _grads(model, tokens, **kwargs):
    model.zero_grad()
    model(tokens, **kwargs).logits.square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_disabling_the_cache_makes_checkpointed_blocks_match_plain_ones(caplog):
    plain, tokens = _llama(), torch.randint(0, 64, (2, 12))
    model = _checkpointed(copy.deepcopy(plain))
    assert model.config.use_cache is True  # the default a user gets
    with caplog.at_level(logging.INFO, logger="lightning_llm.parallel.kv_cache"):
        assert disable_kv_cache(model) == ["LlamaForCausalLM"]
        assert disable_kv_cache(model) == []  # idempotent: nothing left to turn off
    assert model.config.use_cache is False and model.model.config.use_cache is False
    assert [r.getMessage() for r in caplog.records if r.name == "lightning_llm.parallel.kv_cache"] == [
        "Activation checkpointing: set config.use_cache=False on ['LlamaForCausalLM'] (a KV cache cannot be recomputed)"
    ]
    got, want = _grads(model, tokens), _grads(plain, tokens)  # called the ordinary way: model(input_ids)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=0, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_an_explicit_cache_is_refused_by_name_not_as_nondeterminism(mode):
    from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing

    model = _llama()
    apply_activation_checkpointing(list(model.model.layers), mode=mode)
    disable_kv_cache(model)
    with (
        torch.enable_grad(),
        pytest.raises(
            ValueError,
            match=r"LlamaDecoderLayer is activation-checkpointed but "
            r"received a KV cache \((past_key_values|cache)\).*use_cache=False",
        ),
    ):
        model(torch.randint(0, 64, (2, 12)), use_cache=True)  # training: autograd on, whatever ran before
    with torch.no_grad():  # generation (no backward, nothing recomputed) keeps its cache
        assert model(torch.randint(0, 64, (2, 12)), use_cache=True).past_key_values is not None


def test_the_generic_cache_argument_is_refused_only_for_a_hugging_face_cache():
    """transformers 5.24 hands blocks their cache as `cache=`: refused when it is a Cache, not for other values."""
    from transformers import DynamicCache

    from lightning_llm.parallel.kv_cache import refuse_cache_argument

    block = torch.nn.Linear(2, 2)
    refuse_cache_argument(block, {"cache": {"rotary": torch.ones(2)}})  # a model's own use of the name
    refuse_cache_argument(block, {"cache": None, "past_key_values": None})
    for key in ("cache", "cache_params", "past_key_values"):
        with pytest.raises(ValueError, match=rf"Linear is activation-checkpointed but received a KV cache \({key}\)"):
            refuse_cache_argument(block, {key: DynamicCache()})
