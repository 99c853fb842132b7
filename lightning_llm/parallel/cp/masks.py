"""Which keys a query may see under context parallelism, by global position: causal, sliding window, documents.

A rank holds its zig-zag chunks of every sequence, so a mask a model builds from its local shard would be wrong.
The rules are kept instead and applied where the CP attention knows each query's and key's global position:

- **causal**: key ``k`` is visible to query ``q`` iff ``k <= q``;
- **sliding window** ``w`` (Hugging Face's rule, ``masking_utils.sliding_window_overlay``): also ``k > q - w``;
- **packed documents** (the package's ``document_ids``, :func:`~lightning_llm.data.packing.document_causal_mask`):
  also ``document[k] == document[q]``.

The document ids of the running step are the whole sequence's (every CP rank sees the same batch); the model's
input hook records them (:func:`record_documents`) and the attention reads them, also when activation
checkpointing recomputes a block during the backward of the same step (context parallelism refuses pipelining, the
one layout with several micro-batches in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_documents: list[torch.Tensor | None] = [None]


def record_documents(document_ids: torch.Tensor | None) -> None:
    """Keep the (batch, seq) document ids of the step whose forward starts now (``None``: one document each)."""
    _documents[0] = document_ids


@dataclass(frozen=True)
class VisibleKeys:
    """The rule deciding which keys each query sees; ``window`` and ``documents`` as in the module docstring."""

    causal: bool
    window: int | None = None
    documents: torch.Tensor | None = None

    @classmethod
    def of_step(cls, causal: bool, window: int | None) -> VisibleKeys:
        """The rule for an attention call of the running step: its own causality and window, the step's documents."""
        if window is not None and not causal:
            raise ValueError(f"a sliding window ({window}) on non-causal attention is not supported with CP.")
        return cls(causal, window, _documents[0])

    @property
    def masked(self) -> bool:
        """Whether anything beyond plain causality applies (then the kernels need an explicit mask)."""
        return self.window is not None or self.documents is not None

    def first_key(self, q_start: int) -> int:
        """The first key position any query at or after ``q_start`` may see (the window's left edge)."""
        return 0 if self.window is None else max(0, q_start - self.window + 1)

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Boolean (batch or 1, 1, len(q_pos), len(k_pos)) mask, ``True`` where the query attends; ``None``: all."""
        allowed = None
        if self.causal:
            allowed = k_pos[None, :] <= q_pos[:, None]
        if self.window is not None:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - self.window)
        if allowed is not None:
            allowed = allowed[None, None]
        if self.documents is not None:
            documents = self.documents.to(q_pos.device)
            same = documents[:, q_pos][:, :, None] == documents[:, k_pos][:, None, :]
            allowed = same[:, None] if allowed is None else allowed & same[:, None]
        return allowed
