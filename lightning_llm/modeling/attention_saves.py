"""What each attention call saves for backward, in the parts context parallelism divides differently.

The planner divides a block's activations by the context-parallel size C. For attention without a mask that holds
under the ring and Ulysses alike: each rank keeps 1/C of the queries, keys, values, output and log-sum-exp (its
shard, or its heads of the whole sequence). A call with a mask (a sliding window, packed documents) runs otherwise
under CP (:func:`~lightning_llm.parallel.cp.attention.context_parallel_attention`): each rank gathers the keys and
values of the whole sequence, which its kernel calls keep for backward, and builds one mask per query chunk over the
keys up to that chunk's diagonal, which the kernel keeps in the queries' dtype. :class:`AttentionSaves` holds one
call's bytes in those parts; :class:`AttentionSaveCounter` fills them from the tensors autograd saves during each
``F.scaled_dot_product_attention`` call of a measured forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# scaled_dot_product_attention's parameters in order: a call's positional arguments by name.
SDPA_PARAMS = list(inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                      scale=None, enable_gqa=False: None).parameters)  # fmt: skip


@dataclass(frozen=True)
class AttentionSaves:
    """The bytes one attention call saved for backward, in one process over the whole sequence.

    Attributes:
        total: everything the call saved (queries, keys, values, output, log-sum-exp, a mask it made).
        keys_values: of ``total``, the keys' and values' (after any repetition of key/value heads the model did).
        mask: of ``total``, a ``(..., queries, keys)`` mask the call saved (a boolean mask, converted).
        masked: ``0`` for a call without a mask; else the bytes of its whole mask in the queries' dtype (its batch
            rows, or one where it is broadcast over them, times queries times keys), whether or not the call saved it
            (a mask shared by every block is saved once, outside them).
        queries: the bytes of the call's queries.
    """

    total: int
    keys_values: int = 0
    mask: int = 0
    masked: int = 0
    queries: int = 0

    def per_rank(self, cp: int) -> int:
        """Bytes one of ``cp`` context-parallel ranks saves for this call.

        Without a mask, ``1/cp`` of everything. With one: ``1/cp`` of the queries, output and log-sum-exp, the keys
        and values whole, and the masks of the rank's two zig-zag chunks of ``c = T / 2cp`` queries, over ``(r + 1) c``
        and ``(2cp - r) c`` keys: ``(2cp + 1) c^2``, that is ``(2cp + 1) / 4cp^2`` of the whole mask on every rank (a
        sliding window lets the kernel skip keys left of it: an upper bound then), and the two chunks' outputs beside
        their concatenation, the rank's output once more (taken as the queries' bytes).

        Example::

            AttentionSaves(total=100, keys_values=40, masked=64, queries=20).per_rank(2)  # 30 + 40 + 20 + 10 = 100
        """
        if cp == 1:
            return self.total
        if not self.masked:
            return self.total // cp
        rest = self.total - self.keys_values - self.mask
        chunks = self.masked * (2 * cp + 1) // (4 * cp * cp)
        return rest // cp + self.keys_values + chunks + self.queries // cp

    def ring_buffers(self, cp: int) -> int:
        """Bytes the ring's backward (:mod:`lightning_llm.parallel.cp.ring`) allocates for this call on one of ``cp``
        ranks while it runs, besides what the call saved: the query gradient and half a block's query gradient
        (1.5 queries), the travelling keys and values with their gradients (4 times the keys' or values' bytes), and
        half a block's key and value gradients with the contiguous copies of a block's keys and values the kernel's
        backward takes (once more). The kernels take grouped key/value heads as they are; CUDA's memory-efficient
        kernel (fp32) does not, and the ring repeats them per step there, which this does not count. A masked call
        does not run the ring: ``0``.

        Example::

            AttentionSaves(total=0, keys_values=200, queries=400).ring_buffers(2)  # (600 + 400 + 100) / 2
        """
        if cp == 1 or self.masked:
            return 0
        key = self.keys_values // 2
        return (3 * self.queries // 2 + 5 * key) // cp


class AttentionSaveCounter(TorchFunctionMode):
    """Around each ``scaled_dot_product_attention`` call, ``around(query, key, value, attn_mask)`` (a context manager
    that counts what the call saves); ``seen()`` for it and for each ``F.multi_head_attention_forward`` call.

    Example::

        with AttentionSaveCounter(seen=lambda: None, around=tally.attention_call):
            module.training_step(batch, 0)
    """

    def __init__(self, seen: Callable[[], None], around: Callable[..., AbstractContextManager]) -> None:
        super().__init__()
        self.seen, self.around = seen, around

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            self.seen()
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.seen()
        call = dict(zip(SDPA_PARAMS, args), **kwargs)
        with self.around(call["query"], call["key"], call["value"], call.get("attn_mask")):
            return func(*args, **kwargs)
