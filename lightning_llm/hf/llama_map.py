"""The reference :class:`~lightning_llm.models.llama.Llama` <-> Hugging Face ``LlamaForCausalLM``: config, names, rotary rows.

The two models compute the same function with different names and one difference of layout: the
reference rotates *interleaved* channel pairs of each head ((0, 1), (2, 3), ...; Meta's original
convention), Hugging Face rotates the two *halves* ((0, d/2), (1, d/2 + 1), ...; ``rotate_half``).
So the q and k projection rows of each head are permuted on the way out (evens first, then odds) and
back on the way in; everything else is copied as is. ``tests/hf/test_llama_map.py`` checks both
directions on logits.

Example::

    hf_state = {to_hf_name(n): to_hf_tensor(n, t, config) for n, t in llama.state_dict().items()}
    hf_config = to_hf_config(config)          # a transformers.LlamaConfig
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

import torch

from lightning_llm.models.llama import LlamaConfig

# reference name pattern -> Hugging Face name pattern ({i} is the block index)
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _compile(patterns: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [
        (re.compile("^" + re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"), dst.replace("{i}", r"\1"))
        for src, dst in patterns.items()
    ]


_TO_HF = _compile(_NAMES)
_FROM_HF = _compile({hf: ref for ref, hf in _NAMES.items()})


def _rename(name: str, rules: list[tuple[re.Pattern, str]], direction: str) -> str:
    for pattern, replacement in rules:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    raise KeyError(f"{name!r} has no {direction} name: it is not a tensor of the reference Llama / LlamaForCausalLM.")


def to_hf_name(name: str) -> str:
    """``layers.0.attention.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.weight``."""
    return _rename(name, _TO_HF, "Hugging Face")


def from_hf_name(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.attention.q_proj.weight``."""
    return _rename(name, _FROM_HF, "reference Llama")


def _heads(name: str, config: LlamaConfig) -> int | None:
    """Heads whose rows the rotary permutation reorders: q and k projections only."""
    if name.endswith("q_proj.weight"):
        return config.n_heads
    if name.endswith("k_proj.weight"):
        return config.n_kv_heads
    return None


def to_hf_tensor(name: str, tensor: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """The Hugging Face layout of reference tensor ``name``: per head, even rows then odd rows for q and k."""
    heads = _heads(name, config)
    if heads is None:
        return tensor
    rows, cols = tensor.shape
    return tensor.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_tensor(name: str, tensor: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    """The reference layout of Hugging Face tensor ``name`` (the inverse of :func:`to_hf_tensor`)."""
    heads = _heads(name, config)
    if heads is None:
        return tensor
    rows, cols = tensor.shape
    return tensor.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_config(config: LlamaConfig, dtype: torch.dtype = torch.float32):
    """The ``transformers.LlamaConfig`` of a reference :class:`LlamaConfig` (same function, Hugging Face names)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=config.tie_embeddings,
        initializer_range=config.init_std,
        architectures=["LlamaForCausalLM"],
        dtype=dtype,
        # The reference model knows no tokenizer: no special-token ids (LlamaConfig's defaults are Llama 2's 1 and 2).
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"The Hugging Face config uses rope_type={rope.get('rope_type')!r} RoPE scaling; the reference Llama "
            "implements only the default rotary embedding. Load it into transformers.LlamaForCausalLM instead."
        )
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def from_hf_config(hf_config) -> LlamaConfig:
    """The reference :class:`LlamaConfig` computing what ``hf_config`` (a ``transformers.LlamaConfig``) computes.

    Refuses what the reference model does not implement (biases, RoPE scaling, another activation).
    """
    unsupported = {key: True for key in ("attention_bias", "mlp_bias") if getattr(hf_config, key, False)}
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        unsupported["hidden_act"] = hf_config.hidden_act
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim != hf_config.hidden_size // hf_config.num_attention_heads:
        unsupported["head_dim"] = head_dim
    if unsupported:
        raise ValueError(
            f"The Hugging Face config sets {unsupported}, which the reference Llama does not implement; load the "
            "checkpoint into transformers.LlamaForCausalLM instead."
        )
    return LlamaConfig(
        vocab_size=hf_config.vocab_size,
        dim=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads,
        ffn_hidden_dim=hf_config.intermediate_size,
        max_seq_len=hf_config.max_position_embeddings,
        rope_theta=_rope_theta(hf_config),
        norm_eps=hf_config.rms_norm_eps,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        init_std=hf_config.initializer_range,
    )


def check_same_function(model_config: LlamaConfig, hf_config) -> None:
    """Refuse a Hugging Face checkpoint whose config computes something else than ``model_config``'s model.

    Shapes are checked tensor by tensor when loading; this catches what shapes cannot show
    (rotary base, norm epsilon, tied embeddings, head count at equal widths).
    """
    theirs = asdict(from_hf_config(hf_config))
    ours = asdict(model_config)
    differ = {k: (ours[k], theirs[k]) for k in ours if k not in ("init_std", "max_seq_len") and ours[k] != theirs[k]}
    if differ:
        raise ValueError(
            f"The Hugging Face checkpoint's config differs from the reference Llama's (field: (model, checkpoint)): "
            f"{differ}. Build the model with lightning_llm.hf.llama_map.from_hf_config(AutoConfig.from_pretrained(DIR))."
        )


def reference_config(value: Any) -> LlamaConfig | None:
    """A :class:`LlamaConfig` from what a checkpoint stores (the dataclass, its dict, or a preset name), else None."""
    if isinstance(value, LlamaConfig):
        return value
    if isinstance(value, dict):
        return LlamaConfig(**value)
    if isinstance(value, str):
        try:
            return LlamaConfig.from_name(value)
        except ValueError:
            return None
    return None
