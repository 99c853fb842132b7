"""Attention variants under tensor parallelism, recognised from config and module structure (never class names).

Plain multi-head and grouped-query attention split by the name/shape rules of :mod:`.plan`. Some
attention modules need more, and each is recognised here from widths, head counts and config fields:

- **multi-query** (one key/value head, ``(H + 2) * d`` fused outputs or a ``d``-wide ``k_proj``): q is
  split per head, the single k/v head is used whole by every rank with its gradient summed over tp
  (``fused_colwise:Q,*d,*d`` or ``replicate_shared``, see :mod:`.fused` and :mod:`.styles`);
- **fused QKV grouped per KV head** (each group's q heads, then its k, then its v; the config or module
  says so with ``new_decoder_architecture``): contiguous per group, so a plain ``colwise`` split gives
  each rank whole groups;
- **multi-head latent attention** (``config.kv_lora_rank``): low-rank down-projections and their norms
  whole on every rank (the rotary key columns shared by all heads get their gradient summed), the
  up-projections split per head, the output projection row-wise;
- **ALiBi** (a forward argument ``alibi`` or ``position_bias`` with one slice per head) and **per-head
  parameters** of the attention module itself (attention sinks): handled when the plan is applied, by
  :func:`.attention_heads.shard_attention_heads`, for whatever plan split the heads.

:func:`attention_plan` gives the plan entries, :func:`check_attention_variants` refuses what cannot be
split before anything else is looked at.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from lightning_llm.parallel.tp.fused import FUSED_PREFIX, KV_ATTRS, QUERY_ATTRS, projection_dims
from lightning_llm.parallel.tp.heads import attribute, int_attribute

# Config/module flags saying a fused q/k/v projection is laid out per KV group (HF Falcon's new decoder).
GROUPED_FLAGS = ("new_decoder_architecture",)
# Integer attributes that are key/value head counts besides KV_ATTRS (HF GPTBigCode's ``kv_heads``).
SINGLE_KV_ATTRS = (*KV_ATTRS, "kv_heads")


@dataclass
class Variant:
    """What was recognised in one attention module: its kind, head count and plan entries (relative names)."""

    kind: str  # "mqa", "grouped", "mla"
    heads: int
    kv_heads: int
    entries: dict[str, str] = field(default_factory=dict)


def _int_attr(owners: list, names: tuple[str, ...]) -> int | None:
    return int_attribute(owners, names)


def _config(module: nn.Module, config: object | None) -> object | None:
    return getattr(module, "config", None) or config


def head_count(module: nn.Module, config: object | None = None) -> int | None:
    """The query head count of an attention module (its own attribute, else its or the model's config)."""
    return _int_attr([module, _config(module, config)], QUERY_ATTRS)


def is_attention(module: nn.Module) -> bool:
    """A module holding projections directly and a head count or ``head_dim`` of its own (not only a config's)."""
    own = _int_attr([module], (*QUERY_ATTRS, "head_dim")) is not None
    return own and any(projection_dims(child) is not None for child in module.children())


def _projections(module: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: projection_dims(c) for n, c in module.named_children() if projection_dims(c) is not None}


def recognise(attention: nn.Module, config: object | None = None) -> Variant | None:
    """The variant of ``attention`` (see the module docstring), or ``None`` for plain multi-head/GQA attention."""
    config = _config(attention, config)
    heads = head_count(attention, config)
    if heads is None:
        return None
    if isinstance(attribute(config, "kv_lora_rank"), int):
        return _latent(attention, config, heads)
    return _fused(attention, config, heads) or _split_mqa(attention, config, heads)


def _head_dim(attention: nn.Module, config: object, heads: int) -> int | None:
    dim = _int_attr([attention, config], ("head_dim",))
    hidden = _int_attr([attention, config], ("hidden_size", "embed_dim", "d_model", "n_embd"))
    return dim or (hidden // heads if hidden else None)


def _output_projection(projections: dict[str, tuple[int, int]], width: int, exclude: str) -> dict[str, str]:
    return {n: "rowwise" for n, (i, _) in projections.items() if n != exclude and i == width}


def _fused(attention: nn.Module, config: object, heads: int) -> Variant | None:
    """One projection of ``(H + 2 KV) * d`` outputs: multi-query (KV = 1) or grouped per KV head (a flag says so)."""
    dim = _head_dim(attention, config, heads)
    for name, (_, out) in _projections(attention).items():
        if not dim or out % dim or (out // dim - heads) <= 0 or (out // dim - heads) % 2:
            continue
        kv = (out // dim - heads) // 2
        rest = _output_projection(_projections(attention), heads * dim, name)
        if kv == 1 and heads > 1:
            style = f"{FUSED_PREFIX}{heads * dim},*{dim},*{dim}"
            return Variant("mqa", heads, 1, {name: style, **rest})
        grouped = any(getattr(o, f, False) is True for o in (attention, config) for f in GROUPED_FLAGS)
        if 1 < kv < heads and grouped:
            return Variant("grouped", heads, kv, {name: "colwise", **rest})
    return None


def _split_mqa(attention: nn.Module, config: object, heads: int) -> Variant | None:
    """Separate projections where k and v are one head wide (``d``): multi-query.

    k and v are kept whole on every rank; q and the output projection are given here only when their
    shapes tell them apart (a square q and output projection are left to the name rules of the plan).
    """
    dim = _head_dim(attention, config, heads)
    projections = _projections(attention)
    kv = _int_attr([attention, config], SINGLE_KV_ATTRS)
    if not dim or heads == 1 or kv not in (None, 1):
        return None
    shared = [n for n, (_, o) in projections.items() if o == dim]
    if len(shared) != 2:
        return None
    entries = dict.fromkeys(shared, "replicate_shared")
    queries = [n for n, (i, o) in projections.items() if o == heads * dim and i != heads * dim]
    outputs = [n for n, (i, o) in projections.items() if i == heads * dim and o != heads * dim]
    if len(queries) == 1 and len(outputs) == 1:
        entries.update({queries[0]: "colwise", outputs[0]: "rowwise"})
    return Variant("mqa", heads, 1, entries)


def _latent(attention: nn.Module, config: object, heads: int) -> Variant:
    """Multi-head latent attention: down-projections to ``q_lora_rank``/``kv_lora_rank`` (+ the shared rotary key)."""
    q_rank, kv_rank = attribute(config, "q_lora_rank"), config.kv_lora_rank
    rope = _int_attr([attention, config], ("qk_rope_head_dim",)) or 0
    ranks = {r for r in (q_rank, kv_rank) if isinstance(r, int)}
    hidden = _int_attr([attention, config], ("hidden_size",))
    entries = {}
    for name, child in attention.named_children():
        dims = projection_dims(child)
        if dims is None:
            weight = getattr(child, "weight", None)
            if weight is not None and weight.dim() == 1 and weight.numel() in ranks:
                entries[name] = "replicate"  # the latent's norm: whole values, whole gradients on every rank
            continue
        inputs, outputs = dims
        if outputs == kv_rank + rope and kv_rank + rope not in ranks:
            entries[name] = f"replicate_shared:{rope}"  # the rotary key columns feed every head directly
        elif outputs in ranks:
            entries[name] = "replicate_shared:0"
        elif inputs in ranks:
            entries[name] = "colwise_replicated_input"
        elif outputs == hidden:
            entries[name] = "rowwise"
        elif inputs == hidden:
            entries[name] = "colwise"  # q_proj when there is no q down-projection
    kv = _int_attr([attention, config], KV_ATTRS) or heads
    return Variant("mla", heads, kv, entries)


def attention_plan(block: nn.Module, config: object | None = None) -> dict[str, str]:
    """Plan entries (module names inside ``block`` -> style) for the attention variants in ``block``.

    ``config`` is the model's config, read when an attention module holds none. Empty when the block's
    attention is plain multi-head or grouped-query attention (the name/shape rules handle it).

    Example::

        attention_plan(model.transformer.h[0])  # {"attn.c_attn": "fused_colwise:32,*8,*8", "attn.c_proj": "rowwise"}
    """
    plan = {}
    for name, module in block.named_modules():
        if isinstance(module, nn.MultiheadAttention):  # PyTorch's own: q/k/v in one Parameter, its own style
            plan[name] = "multihead_attention"
            continue
        variant = recognise(module, config) if is_attention(module) else None
        if variant is not None:
            plan.update({f"{name}.{child}" if name else child: s for child, s in variant.entries.items()})
    return plan


def shares_kv(plan: dict[str, str]) -> bool:
    """Whether ``plan`` gives some layer a key/value head that every rank uses whole (multi-query attention)."""
    return any(s == "replicate_shared" or (s.startswith(FUSED_PREFIX) and "*" in s) for s in plan.values())


def model_config(model: nn.Module) -> object | None:
    """The first ``config`` on ``model`` or a submodule that carries a query head count."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and _int_attr([config], QUERY_ATTRS) is not None:
            return config
    return None


def alibi_argument(attention: nn.Module) -> str | None:
    """The name of ``attention``'s forward argument carrying a per-head ALiBi bias, if it has one."""
    parameters = inspect.signature(attention.forward).parameters
    return next((n for n in ("alibi", "position_bias") if n in parameters), None)


def per_head_parameters(attention: nn.Module, heads: int) -> list[str]:
    """The attention module's own parameters with one entry per head along dim 0 (attention sinks, head scales)."""
    return [n for n, p in attention.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == heads]


def check_attention_variants(block: nn.Module, tp: int, config: object | None = None, where: str = "block") -> None:
    """Refuse, first, an attention variant whose heads do not split over ``tp``, saying what would work.

    Example::

        check_attention_variants(model.transformer.h[0], tp=3)  # ValueError: 4 query heads over 3 ranks
    """
    for name, module in block.named_modules():
        if not is_attention(module):
            continue
        variant = recognise(module, config)
        heads = head_count(module, config)
        kind = variant.kind if variant else None
        if kind is None and (alibi_argument(module) or per_head_parameters(module, heads or -1)):
            kind = "alibi" if alibi_argument(module) else "per-head parameters"
        counts = {"query heads": heads}
        if kind == "grouped":
            counts["key/value groups"] = variant.kv_heads
        bad = {k: v for k, v in counts.items() if v and v % tp}
        if kind and bad:
            label, value = next(iter(bad.items()))
            fits = [d for d in range(2, max(counts.values()) + 1) if all(v % d == 0 for v in counts.values() if v)]
            raise ValueError(
                f"{where}.{name} ({_DESCRIBE[kind]}) has {value} {label}, not divisible by tensor_parallel_size={tp}: "
                f"each rank must hold whole heads. Use a tensor_parallel_size that divides {value} "
                f"({fits[:4] or 'none above 1'}), or split the model another way: pipeline_parallel_size "
                "(whole blocks per rank) or zero_stage=3 (sharded parameters, whole heads)."
            )


_DESCRIBE = {
    "mqa": "multi-query attention: q split per head, the one k/v head on every rank",
    "grouped": "fused q/k/v grouped per key/value head, split per group",
    "mla": "multi-head latent attention: up-projections split per head",
    "alibi": "ALiBi attention: each rank applies its own heads' slopes",
    "per-head parameters": "attention with per-head parameters, split with their heads",
}
