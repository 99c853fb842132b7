"""Byte-level tokenizer: UTF-8 bytes are the tokens, so any text round-trips with a 256-entry vocabulary."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Encodes text to its UTF-8 bytes (vocabulary 256) and back.

    Example::

        tok = ByteTokenizer()
        assert tok.decode(tok.encode("héllo")) == "héllo"
    """

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
