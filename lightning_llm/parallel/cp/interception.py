"""Route every block's attention to the CP attention (:func:`attend`), without changing the model.

- **Hugging Face models** call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` in each attention module:
  a function is registered under :data:`CP_ATTENTION` (``transformers.AttentionInterface``) and the model switched
  to it with ``set_attn_implementation``. No mask function is registered under that name, so transformers builds
  no (local, wrong-sized) mask; causality is applied by global position instead.
- **SDPA-based models** (the reference model, user models) call ``F.scaled_dot_product_attention``: a
  ``TorchFunctionMode`` entered by each block's forward pre-hook and left by its forward hook redirects those calls;
  ``nn.MultiheadAttention``'s ``F.multi_head_attention_forward`` is redirected whole (:mod:`.multihead`).

Each routed block's hooks open a :func:`block_call` around its forward (a ``ContextVar``: the block's CP group and
a count of the attention calls it routed), which the attention function reads: nothing is kept on the model's
modules or in a module-level registry. Either way each block must have routed at least one attention call through CP by the end of its forward; a block
that computed attention some other way (an eager softmax) would see only its shard's keys, so it is refused. Blocks
the traced forward ran no attention in are not routed: their mixers run on the gathered sequence (:mod:`.gathered`),
where an attention call computes plain attention over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_llm._compat.transformers import attention_implementation
from lightning_llm.modeling.attention_saves import SDPA_PARAMS
from lightning_llm.parallel.cp.attention import context_parallel_attention
from lightning_llm.parallel.cp.gathered import in_gathered
from lightning_llm.parallel.cp.layout import CPGroup
from lightning_llm.parallel.cp.masks import VisibleKeys
from lightning_llm.parallel.cp.multihead import multi_head_attention
from lightning_llm.parallel.cp.positions import cp_own_code
from lightning_llm.parallel.cp.ring import ring_attention
from lightning_llm.parallel.cp.ulysses import ulysses_attention

CP_ATTENTION = "lightning_llm_context_parallel"


@dataclass
class BlockCall:
    """A routed block's forward while it runs: its CP group and the attention calls routed so far."""

    cp: CPGroup
    calls: int = 0


_CALL: ContextVar[BlockCall | None] = ContextVar("lightning_llm_cp_block_call", default=None)


@contextmanager
def block_call(cp: CPGroup) -> Iterator[BlockCall]:
    """Run a routed block's forward: its attention goes over ``cp`` (what the block hooks open around it)."""
    token = _CALL.set(call := BlockCall(cp))
    try:
        yield call
    finally:
        _CALL.reset(token)


def attend(query, key, value, cp: CPGroup, *, is_causal: bool, scale: float | None, window: int | None = None):
    """The CP attention of ``cp.method``: Ulysses' all-to-all, or the send/recv ring (measured faster than the
    all-gather from 8K tokens on 2 gloo ranks, and holding two key/value shards at most).

    A sliding ``window`` or the step's packed documents (:mod:`.masks`) need a mask by global position, which the
    ring's and Ulysses' mask-free kernels do not take: those calls gather the keys and values
    (:func:`~.attention.context_parallel_attention`), whichever the method.
    """
    rule = VisibleKeys.of_step(is_causal, window)
    with cp_own_code():  # global positions already: nothing here is the model's own position computation
        if rule.masked:
            return context_parallel_attention(query, key, value, cp, is_causal=is_causal, scale=scale, rule=rule)
        fn = ulysses_attention if cp.method == "ulysses" else ring_attention
        return fn(query, key, value, cp, is_causal=is_causal, scale=scale)


def _count_call() -> None:
    if (call := _CALL.get()) is not None:
        call.calls += 1


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    if in_gathered():  # the whole sequence is here: plain attention
        return _plain_hf_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    call = _CALL.get()
    if call is None:
        raise RuntimeError(
            f"{type(module).__name__} runs context-parallel attention outside the blocks context parallelism routes."
        )
    cp = call.cp
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"context parallelism does not support attention with `{name}` yet ({type(module).__name__})."
            )
    window = kwargs.get("sliding_window")
    if getattr(module, "sliding_window", None) and window is None:  # the layer's window must reach the kernel
        raise ValueError(
            f"{type(module).__name__} has sliding_window={module.sliding_window} but did not pass it to its "
            "attention function, so context parallelism cannot apply it; use context_parallel_size=1 for this model."
        )
    if attention_mask is not None or dropout:
        raise ValueError(
            f"context parallelism computes plain causal attention; {type(module).__name__} passed "
            f"{'a mask' if attention_mask is not None else f'dropout={dropout}'}, which it cannot split yet."
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    _count_call()
    out = attend(query, key, value, cp, is_causal=causal, scale=scaling, window=window)
    return out.transpose(1, 2).contiguous(), None


def _plain_hf_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"{type(module).__name__} runs sliding-window attention inside a module context parallelism runs on the "
            "gathered sequence; use context_parallel_size=1 for this model."
        )
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


class _SDPARouter(TorchFunctionMode):
    """Redirects ``F.scaled_dot_product_attention`` calls to the CP attention while a block's forward runs."""

    def __init__(self, cp: CPGroup, where: str) -> None:
        super().__init__()
        self.cp, self.where = cp, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if in_gathered():  # the whole sequence is here: the model's own call is exact
            return func(*args, **kwargs)
        if func is F.multi_head_attention_forward:  # its own SDPA call would run with this mode off
            _count_call()
            return multi_head_attention(args, kwargs, self.where, partial(attend, cp=self.cp))
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(SDPA_PARAMS, args), **kwargs)
        if call.get("attn_mask") is not None or call.get("dropout_p", 0.0):
            raise ValueError(
                f"context parallelism computes causal attention by global position; {self.where} passed "
                f"scaled_dot_product_attention an attn_mask or dropout_p, which it cannot split yet."
            )
        _count_call()
        return attend(
            call["query"], call["key"], call["value"], self.cp, is_causal=call.get("is_causal", False),
            scale=call.get("scale"),
        )  # fmt: skip


def _switch_hf_attention(model: nn.Module) -> bool:
    """Switch a Hugging Face model to :data:`CP_ATTENTION`; ``False`` for a model without an attention registry."""
    if attention_implementation(model) is None or not callable(getattr(model, "set_attn_implementation", None)):
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _hf_attention)
    model.set_attn_implementation(CP_ATTENTION)
    if attention_implementation(model) != CP_ATTENTION:
        raise ValueError(
            f"{type(model).__name__} does not let its attention implementation be switched to {CP_ATTENTION!r} "
            "(transformers' set_attn_implementation refused), so context parallelism cannot distribute its "
            "attention; use context_parallel_size=1 for this model."
        )
    return True


_UNTRACED = (
    " No trace of the forward was given, which finds the blocks that run no attention and runs them whole: the "
    "strategy's setup traces a training_step that runs on fake tensors (where it cannot, the reason is in the DEBUG "
    "log of lightning_llm.strategies.parallel_setup); a direct parallelize(...) call takes it as traced=."
)


def _block_hooks(
    block: nn.Module, where: str, cp: CPGroup, router: _SDPARouter | None, traced: bool
) -> list[RemovableHandle]:
    running: list = []  # the open block_call contexts (a block re-entered by activation checkpointing's recompute)

    def enter(module, args):
        running.append(block_call(cp))
        running[-1].__enter__()
        if router is not None:
            router.__enter__()

    def leave(module, args, output):
        if router is not None:
            router.__exit__(None, None, None)
        calls = _CALL.get().calls
        running.pop().__exit__(None, None, None)
        if calls == 0:
            raise RuntimeError(
                f"{where} computed no attention through context parallelism (no scaled_dot_product_attention or "
                "Hugging Face attention-function call): its attention would see only this rank's shard of the "
                "sequence. Use SDPA in its attention, or context_parallel_size=1." + ("" if traced else _UNTRACED)
            )

    return [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]


def route_attention(
    model: nn.Module,
    blocks: list[nn.Module],
    cp: CPGroup,
    *,
    blocks_name: str,
    unrouted: set[int] = frozenset(),
    traced: bool = True,
) -> str:
    """Make every block of ``model`` compute attention with CP; returns how ("transformers registry"/"SDPA").

    ``unrouted``: the indices of blocks that run no attention (their mixers compute on the gathered sequence).
    ``traced``: whether ``unrouted`` comes from a traced forward (else a block computing no attention is refused
    with the reason the trace would have run it whole).

    Example::

        route_attention(hf_model, list(hf_model.model.layers), CPGroup(group, 2, rank), blocks_name="model.layers")
    """
    hf = _switch_hf_attention(model)
    for index, block in enumerate(blocks):
        if index in unrouted:
            continue
        where = f"block {blocks_name}.{index}"
        _block_hooks(block, where, cp, None if hf else _SDPARouter(cp, where), traced)
    return "transformers attention registry" if hf else "SDPA inside the blocks"
