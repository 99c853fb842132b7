"""Packed documents: fixed-length windows over EOS-separated documents, with per-position document ids.

A token file from ``lightning-llm prepare`` holds ``doc0 EOS doc1 EOS ...``; windows of ``seq_len + 1``
tokens over it pack several documents (or pieces of them) into every sample, with no padding. For
document-masked attention each position also gets a document id: ids count the documents of the
window from 0, and an EOS belongs to the document it ends. :func:`document_causal_mask` turns them
into the block-diagonal causal mask ``scaled_dot_product_attention`` takes, so no token attends across a
document boundary. Because rotary embeddings depend only on relative positions, a document then gets
the same outputs packed as alone.

Example::

    ds = PackedDocuments(tokens, seq_len=2048, offsets=read_offsets("data/train.bin"))
    sample = ds[0]  # {"input_ids": (2049,), "document_ids": (2049,)}
    mask = document_causal_mask(sample["document_ids"][None, :-1])  # (1, 1, 2048, 2048) bool
"""

from __future__ import annotations

import numpy as np
import torch

from lightning_llm.data.datasets import TokenWindows


class PackedDocuments(TokenWindows):
    """:class:`TokenWindows` whose samples are dicts ``{"input_ids", "document_ids"}``, both ``(seq_len + 1,)``.

    ``input_ids`` is the window of inputs plus the shifted target, as a plain ``TokenWindows`` sample
    (the model shifts it); ``document_ids[t]`` numbers the documents of the window from 0. The keys are
    those of a Hugging Face batch, so ``batch["input_ids"]`` reads the same in both; the DataLoader's
    default collation stacks them into ``(batch, seq_len + 1)`` tensors.

    Arguments:
        tokens: the flat token array (memory-mapped or in memory).
        seq_len: tokens per sample.
        offsets: sorted start offsets of the documents in ``tokens`` (a trailing end entry is allowed).

    Example::

        ds = PackedDocuments(np.array([5, 6, 0, 7, 0]), seq_len=4, offsets=np.array([0, 3, 5]))
        assert ds[0]["document_ids"].tolist() == [0, 0, 0, 1, 1]
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, offsets: np.ndarray) -> None:
        super().__init__(tokens, seq_len)
        if len(offsets) == 0 or int(offsets[0]) != 0:
            raise ValueError(f"Document offsets must start at 0 (the first document), got {np.asarray(offsets[:3])}.")
        self.offsets = offsets

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = super().__getitem__(index)
        start = index * self.seq_len
        positions = np.arange(start, start + len(window), dtype=np.uint64)
        documents = np.searchsorted(self.offsets, positions, side="right").astype(np.int64)
        return {"input_ids": window, "document_ids": torch.from_numpy(documents - documents[0])}


def split_offsets(offsets: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The document start offsets within ``tokens[start:stop]``, relative to ``start`` (0 always first).

    Example::

        assert split_offsets(np.array([0, 4, 9, 12]), 6, 12).tolist() == [0, 3]
    """
    offsets = np.asarray(offsets, dtype=np.uint64)
    inside = offsets[(offsets > start) & (offsets < stop)] - np.uint64(start)
    return np.concatenate((np.zeros(1, dtype=np.uint64), inside))


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal attention mask: query ``q`` sees key ``k`` iff ``k <= q`` and both are one document.

    Takes ``(batch, seq)`` document ids and returns a ``(batch, 1, seq, seq)`` boolean mask (``True``
    attends), broadcast over heads by ``torch.nn.functional.scaled_dot_product_attention(attn_mask=...)``.
    Memory is ``seq**2`` booleans per sample; for long sequences on GPUs, flex attention's block masks
    express the same rule without materializing it.

    Example::

        mask = document_causal_mask(torch.tensor([[0, 0, 1]]))
        assert mask[0, 0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be (batch, seq), got shape {tuple(document_ids.shape)}.")
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_document & causal)[:, None]
