"""Counting the samples and tokens of a training batch from its shapes (no device synchronisation)."""

from __future__ import annotations

from typing import Any

import torch


def batch_tokens(batch: Any, shifted_targets: bool) -> tuple[int, int]:
    """(samples, trained tokens) of a batch, from shapes only (no device synchronisation).

    A (batch, seq_len + 1) token tensor trains seq_len tokens per sample when ``shifted_targets``;
    dicts are read through their ``input_ids``.
    """
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    if not isinstance(batch, torch.Tensor) or batch.dim() < 2:
        raise TypeError("MFUMonitor counts tokens of (batch, seq_len) tensors or dicts with 'input_ids'.")
    samples, length = batch.shape[0], batch.shape[1] - (1 if shifted_targets else 0)
    return samples, samples * length
