"""A Hugging Face KV cache and activation checkpointing (or pipeline stages) do not mix; turn the cache off.

A Hugging Face decoder called the ordinary way (``model(input_ids)``, ``use_cache`` at its config's
default ``True``) appends each block's keys and values to a cache object inside the block. A
checkpointed block runs twice, so its recomputation appends again and sees different tensors than
the forward did: torch then reports a "nondeterministic" region (selective) or the attention shapes
disagree (full). Under pipeline parallelism a stage runs some blocks only, and a hybrid model's cache (Zamba2's,
one entry per layer of its own kind) is handed blocks it does not hold. Hugging Face's own
``gradient_checkpointing_enable`` sets ``config.use_cache = False``
for the same reason; :func:`disable_kv_cache` does the same for any model holding such configs, and
:func:`refuse_cache_argument` stops a block that is handed a cache anyway, before any backward runs.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)

# Keyword arguments through which Hugging Face blocks receive the cache (the name changed across versions).
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")
# transformers 5.24 renamed it `cache` (`cache_params` in state-space models): names generic enough that
# another model may use them for something else, so there only an object with Hugging Face's Cache interface counts.
CACHE_OBJECT_ARGUMENTS = ("cache", "cache_params")


def disable_kv_cache(
    module: nn.Module, who: str = "Activation checkpointing", why: str = "a KV cache cannot be recomputed"
) -> list[str]:
    """Set ``config.use_cache = False`` on every submodule's config that has it on; return those modules' names.

    Example::

        disable_kv_cache(lightning_module)   # ['model'] for a LightningModule holding LlamaForCausalLM as .model
    """
    changed, seen = [], set()
    for name, submodule in module.named_modules():
        config = getattr(submodule, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            changed.append(name or type(submodule).__name__)
    if changed:
        log.info(f"{who}: set config.use_cache=False on {changed} ({why})")
    return changed


def refuse_cache_argument(block: nn.Module, kwargs: dict) -> None:
    """Raise if a checkpointed block is handed a KV cache (``use_cache=True`` passed explicitly)."""
    for key in (*CACHE_ARGUMENTS, *CACHE_OBJECT_ARGUMENTS):
        value = kwargs.get(key)
        if value is not None and (key in CACHE_ARGUMENTS or hasattr(value, "get_seq_length")):
            raise ValueError(
                f"{type(block).__name__} is activation-checkpointed but received a KV cache ({key}); the recomputation "
                "would append to it a second time. Train with use_cache=False (do not pass use_cache=True to the "
                "model's forward), or set activation_checkpointing='none'."
            )
