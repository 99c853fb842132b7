"""Datasets of fixed-length token windows over a 1-D token array (in memory or memory-mapped)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus the shifted target).

    Window ``i`` starts at token ``i * seq_len``, so consecutive windows share one token and
    every token is a target exactly once. Works on a ``np.memmap`` without reading it whole.

    Example::

        ds = TokenWindows(np.arange(1000), seq_len=16)
        assert ds[0].shape == (17,)
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"Expected a 1-D token array, got shape {tokens.shape}.")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter seq_len."
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)


def read_token_file(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """Memory-map a flat binary file of token ids (e.g. written by ``array.astype(np.uint16).tofile``)."""
    path = Path(path)
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype={dtype!r} is not supported; use one of {sorted(TOKEN_DTYPES)}.")
    if not path.is_file():
        raise FileNotFoundError(f"Token file not found: {path}. Check `data.path` in your config.")
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if not path.stat().st_size:  # numpy would say only "cannot mmap an empty file"
        raise ValueError(f"Token file {path} is empty (0 bytes); remove it from `data.path` or prepare it again.")
    if path.stat().st_size % itemsize:
        raise ValueError(
            f"{path} has {path.stat().st_size} bytes, not a whole number of {dtype} tokens; is token_dtype right?"
        )
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def read_text_files(paths: list[str | Path], encode) -> np.ndarray:
    """Concatenate the encoded contents of text files into one token array."""
    arrays = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"Text file not found: {path}. Check `data.path` in your config.")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"Text file {path} is not UTF-8 (byte {err.object[err.start]:#04x} at offset {err.start}); convert it "
                "(e.g. `iconv -t UTF-8`) or tokenize it yourself and use source='tokens'."
            ) from None
        if not text:
            raise ValueError(f"Text file {path} is empty; remove it from `data.path` or give it some text.")
        arrays.append(encode(text))
    return np.concatenate(arrays)
