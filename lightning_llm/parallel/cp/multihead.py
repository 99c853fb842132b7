"""``nn.MultiheadAttention`` through the CP attention.

PyTorch's ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``) calls
``F.multi_head_attention_forward``, which hands the whole call to an active ``TorchFunctionMode`` and runs its
body, and the SDPA call inside it, with that mode off. The SDPA router (:mod:`.interception`) therefore sees this
function, not its SDPA call, and runs it here: the same input projections, the CP attention, the same output
projection. Written by hand because torch has no hook between its projections and its SDPA call.

What the CP attention cannot split exactly is refused by name: a padding mask, an attention mask that is not
the causal hint (``is_causal=True`` with ``need_weights=False``, as the Transformer layers pass it), attention
weights asked for (``need_weights=True``, ``nn.MultiheadAttention``'s default), ``bias_k``/``bias_v``, ``add_zero_attn``, static keys/values, and dropout while training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

_PARAMS = list(inspect.signature(F.multi_head_attention_forward).parameters)


def _refusal(call: dict) -> str | None:
    causal_hint = call.get("is_causal", False) and not call.get("need_weights", True)
    checks = {
        "a key_padding_mask": call.get("key_padding_mask") is not None,
        "an attn_mask other than the causal hint": call.get("attn_mask") is not None and not causal_hint,
        "need_weights=True (attention weights cannot be returned)": call.get("need_weights", True),
        "bias_k / bias_v": call["bias_k"] is not None or call["bias_v"] is not None,
        "add_zero_attn=True": call["add_zero_attn"],
        "static_k / static_v": call.get("static_k") is not None or call.get("static_v") is not None,
        "attention dropout": call["dropout_p"] > 0 and call.get("training", True),
        "unbatched inputs": call["query"].dim() != 3,
    }
    found = [name for name, present in checks.items() if present]
    return ", ".join(found) or None


def _projections(call: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as ``F.multi_head_attention_forward`` projects them (inputs sequence-first: (seq, batch, embed))."""
    bias, query = call["in_proj_bias"], call["query"]
    if not call.get("use_separate_proj_weight") and query is call["key"] is call["value"]:  # self-attention, packed
        return F.linear(query, call["in_proj_weight"], bias).chunk(3, dim=-1)
    biases = bias.chunk(3) if bias is not None else (None, None, None)
    if call.get("use_separate_proj_weight"):
        weights = (call["q_proj_weight"], call["k_proj_weight"], call["v_proj_weight"])
    else:
        weights = call["in_proj_weight"].chunk(3)
    inputs = (call["query"], call["key"], call["value"])
    return tuple(F.linear(x, w, b) for x, w, b in zip(inputs, weights, biases))


def multi_head_attention(args: tuple, kwargs: dict, where: str, attend: Callable[..., torch.Tensor]):
    """``F.multi_head_attention_forward(*args, **kwargs)`` with ``attend(q, k, v, is_causal=, scale=)`` as its
    attention; returns ``(output, None)`` like the function with ``need_weights=False``.

    Example::

        out, _ = multi_head_attention(args, kwargs, "block 0", lambda q, k, v, **kw: sdpa(q, k, v, **kw))
    """
    call = dict(zip(_PARAMS, args), **kwargs)
    refused = _refusal(call)
    if refused:
        raise ValueError(
            f"context parallelism computes causal attention by global position; {where}'s nn.MultiheadAttention was "
            f"called with {refused}, which it cannot split yet. Call it with is_causal=True (and need_weights=False), "
            "or use context_parallel_size=1."
        )
    heads = call["num_heads"]
    length, batch, embed = call["query"].shape

    def to_heads(x: torch.Tensor) -> torch.Tensor:  # (seq, batch, heads * dim) -> (batch, heads, seq, dim)
        return x.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)

    q, k, v = (to_heads(x) for x in _projections(call))
    out = attend(q, k, v, is_causal=bool(call.get("is_causal", False)), scale=None)
    out = out.permute(2, 0, 1, 3).reshape(length * batch, embed)
    out = F.linear(out, call["out_proj_weight"], call["out_proj_bias"])
    return out.view(length, batch, embed), None
