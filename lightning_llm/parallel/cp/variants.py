"""Attention variants context parallelism cannot yet distribute exactly, refused at setup by name.

Recurrent and convolutional mixers are not refused: they run on the gathered sequence (:mod:`.gathered`).
The CP attention (:mod:`.attention`) computes plain softmax attention, causal or not, by global position. A
model whose attention adds anything per (query, key) pair that this does not know about would be silently wrong, so
each such feature is recognised from the config and the modules (never class names) and refused before training:
softcapped logits, ALiBi / position biases, attention sinks, attention dropout (not reproducible across shards),
sliding windows outside Hugging Face's attention registry (there each layer hands its window to the CP attention).
A forward without ``position_ids`` has its learned position table looked up by global position, or is refused at
its first forward (:mod:`.positions`); under pipeline parallelism (stages run parts of the forward) it is refused
here.
"""

from __future__ import annotations

import inspect

from torch import nn

from lightning_llm._compat.transformers import attention_implementation
from lightning_llm.parallel.tp.attention_variants import alibi_argument, is_attention, model_config

_FIX = "use context_parallel_size=1 for this model (or a model without it)"


def _sliding_window(config: object) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and not any("sliding" in str(t) for t in layer_types):
        return None
    return window


def unsupported_features(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """The features of ``model``'s attention that CP would get wrong, each named with where it was found."""
    config = model_config(model)
    found = []
    if config is not None:
        if getattr(config, "attn_logit_softcapping", None):
            found.append(f"attention logit softcapping (config.attn_logit_softcapping={config.attn_logit_softcapping})")
        if (window := _sliding_window(config)) is not None and attention_implementation(model) is None:
            # Hugging Face models pass each layer's window to the attention function, which applies it.
            found.append(f"sliding-window attention outside transformers' attention registry (window {window})")
        if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
            found.append("ALiBi position biases (config)")
        for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
            if isinstance(getattr(config, name, None), float) and getattr(config, name) > 0:
                found.append(f"attention dropout (config.{name}={getattr(config, name)})")
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            where = f"block {index}" + (f" ({name})" if name else "")
            if is_attention(module) and alibi_argument(module):
                found.append(f"ALiBi / position-bias argument {alibi_argument(module)!r} in {where}")
            if any(p.split(".")[-1] in ("sinks", "attention_sinks") for p, _ in module.named_parameters(recurse=False)):
                found.append(f"attention sinks in {where}")
        if found:
            break  # one block names every feature its class has
    return found


def check_context_parallel_model(
    model: nn.Module, blocks: list[nn.Module], *, where: str, pipelined: bool = False
) -> None:
    """Refuse, naming the feature, a model whose attention or positions CP cannot distribute exactly."""
    found = unsupported_features(model, blocks)
    if found:
        raise ValueError(
            f"context parallelism cannot split the attention of {where} exactly: it uses {'; '.join(found)}. "
            f"These are not supported with context_parallel_size > 1 yet; {_FIX}."
        )
    parameters = inspect.signature(model.forward).parameters
    if pipelined and "position_ids" not in parameters:
        raise ValueError(
            f"{where}.forward({', '.join(parameters)}) takes no `position_ids`: under context parallelism with "
            "pipeline parallelism each rank holds a shard of every sequence and runs part of the forward, so "
            "positions computed inside the model would restart in every shard. "
            "Give its forward a `position_ids` argument (global positions of the tokens it receives), or "
            f"{_FIX}."
        )
