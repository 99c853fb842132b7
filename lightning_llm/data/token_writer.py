"""``prepare``'s output files: the tokens of each split appended to its ``.bin``, their document offsets to the
``.idx`` beside it (:mod:`lightning_llm.data.token_files`), with a progress bar."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from lightning_llm.data.token_files import offsets_path


class TokenWriter:
    """Appends documents to ``path`` and their start offsets to the ``.idx`` beside it."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self.documents = self.tokens = 0

    def __enter__(self) -> TokenWriter:
        self._tokens, self._offsets = self.path.open("wb"), offsets_path(self.path).open("wb")
        return self

    def write(self, tokens: np.ndarray, lengths: list[int]) -> None:
        starts = self.tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        self._tokens.write(tokens.astype(self.dtype).tobytes())
        self._offsets.write(starts.astype(np.uint64).tobytes())
        self.documents += len(lengths)
        self.tokens += len(tokens)

    def __exit__(self, *exc) -> None:
        self._offsets.write(np.asarray([self.tokens], dtype=np.uint64).tobytes())  # the end, as a last entry
        self._tokens.close()
        self._offsets.close()


def write_runs(runs, writers: dict[str, TokenWriter], progress: bool | None) -> None:
    """Append every (split, lengths, tokens) run to its split's files (in the staging folder)."""
    with contextlib.ExitStack() as stack:
        for writer in writers.values():
            stack.enter_context(writer)
        bar = stack.enter_context(progress_bar(progress))
        for split, lengths, tokens in runs:
            writers[split].write(tokens, lengths)
            bar.update(len(lengths))


def progress_bar(enabled: bool | None):
    """A bar counting documents; ``None``: shown only when stderr is a terminal."""
    from tqdm import tqdm

    # disable=None: tqdm shows the bar only when stderr is a terminal (quiet in logs and CI).
    return tqdm(desc="Tokenizing", unit=" docs", disable=None if enabled is None else not enabled, leave=False)
