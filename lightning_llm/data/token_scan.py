"""Reading a token array cheaply, once, before the first step: its largest id, and whether it was read as the dtype
it was written in.

Both run over memory-mapped files that may be terabytes (read by every rank), so they read whole arrays up to a
limit and evenly spaced chunks past it: startup stays seconds, and what a sample misses still fails loudly later
(an out-of-vocabulary id raises an IndexError in training).

Example::

    tokens = np.memmap("data/train.bin", dtype=np.uint16, mode="r")
    check_token_dtype("data/train.bin", tokens, "uint16", "token_dtype='uint16'")
    print(max_token(tokens))
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

# Tokens read in full by the vocabulary check (about 1-4 GB); a larger corpus is read in evenly spaced chunks
# adding up to this many tokens instead.
SCAN_LIMIT = 1 << 30
CHUNK = 1 << 24
# The dtype check stops at the first chunk whose odd positions are not all 0 (the first chunk of any real uint16
# file); only a file that is wrong is read this far.
DTYPE_SCAN_LIMIT = 1 << 24
DTYPE_CHUNK = 1 << 20


def chunks(tokens: np.ndarray, chunk: int = CHUNK, limit: int = SCAN_LIMIT) -> Iterator[np.ndarray]:
    """``tokens`` in slices of ``chunk`` (each starting at a multiple of ``chunk``); past ``limit`` tokens, only
    evenly spaced slices adding up to ``limit``."""
    starts: range | list[int] = range(0, len(tokens), chunk)
    if len(tokens) > limit:
        count = max(limit // chunk, 1)
        starts = sorted({int(i * len(tokens) / count) // chunk * chunk for i in range(count)})
    for start in starts:
        yield tokens[start : start + chunk]


def max_token(tokens: np.ndarray, chunk: int = CHUNK, limit: int = SCAN_LIMIT) -> int:
    """The largest token id in ``tokens`` (-1 when empty), read in chunks; past ``limit``, from a sample."""
    if not len(tokens):
        return -1
    return max(int(part.max()) for part in chunks(tokens, chunk, limit))


def check_token_dtype(path: str, tokens: np.ndarray, dtype: str, said_by: str) -> None:
    """Refuse a file of 32-bit ids read as ``uint16``: every second id read is 0 (the high halves), the others are
    the real ids, and each fits any vocabulary, so nothing else would notice.

    ``said_by`` names where the dtype came from (``"token_dtype='uint16'"``, a sidecar, the default), for the fix.
    """
    if dtype != "uint16" or len(tokens) < 16 or len(tokens) % 2:
        return
    low = 0
    for part in chunks(tokens, DTYPE_CHUNK, DTYPE_SCAN_LIMIT):  # even chunk starts: odd positions are high halves
        if part[1::2].any():
            return
        low = max(low, int(part[0::2].max()))
    if low:
        raise ValueError(
            f"{path} looks like 32-bit token ids read as uint16 ({said_by}): every second id read is 0, the high "
            f"half of a uint32 id (the first ids read: {np.asarray(tokens[:6]).tolist()}). Set "
            "token_dtype='uint32', or write the file with `lightning-llm prepare` (its sidecar records the dtype)."
        )
