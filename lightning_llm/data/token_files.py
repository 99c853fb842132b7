"""The token file format: flat ids, a JSON sidecar describing them and a ``.idx`` of document offsets.

``lightning-llm prepare`` writes, for ``train.bin``:

* ``train.bin``: the token ids, flat, ``uint16`` when the vocabulary fits (at most 65536 ids) else
  ``uint32``; every document is followed by the EOS id.
* ``train.json``: ``{"format", "dtype", "vocab_size", "eos_id", "tokenizer", "num_documents", "num_tokens"}``;
  ``tokenizer`` is relative to the sidecar's folder when inside it.
* ``train.idx``: ``uint64`` start offsets (in tokens) of every document, plus the total as a last entry,
  so document ``i`` is ``tokens[idx[i]:idx[i + 1]]`` (its EOS included).

:class:`~lightning_llm.data.LLMDataModule` reads the sidecar, so the dtype and vocabulary need not be
repeated in a config, and the offsets for document ids.

Example::

    info = read_token_info("data/train.bin")  # None when there is no sidecar
    print(info.dtype, info.vocab_size, info.eos_id)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

FORMAT = "lightning_llm.tokens/1"


@dataclasses.dataclass(frozen=True)
class TokenFileInfo:
    """What the sidecar of a token file says about it."""

    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer: str | None
    num_documents: int
    num_tokens: int
    format: str = FORMAT


def token_dtype_for(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits in 16 bits (ids 0..65535), else ``"uint32"``.

    Example::

        assert token_dtype_for(50257) == "uint16" and token_dtype_for(128256) == "uint32"
    """
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size={vocab_size} does not fit uint32 token files; use a vocabulary of at most 2**32.")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sidecar_path(token_file: str | Path) -> Path:
    """``train.bin`` -> ``train.json``."""
    return Path(token_file).with_suffix(".json")


def offsets_path(token_file: str | Path) -> Path:
    """``train.bin`` -> ``train.idx``."""
    return Path(token_file).with_suffix(".idx")


def write_token_info(token_file: str | Path, info: TokenFileInfo) -> Path:
    """Write the sidecar of ``token_file``; returns its path."""
    path = sidecar_path(token_file)
    path.write_text(json.dumps(dataclasses.asdict(info), indent=2) + "\n")
    return path


def read_token_info(token_file: str | Path) -> TokenFileInfo | None:
    """The sidecar of ``token_file``, or ``None`` when it has none (a token file written by other tools)."""
    path = sidecar_path(token_file)
    if not path.is_file():
        return None
    try:
        fields = json.loads(path.read_text())
        info = TokenFileInfo(**fields)
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(
            f"{str(path)!r} is not a token-file sidecar written by `lightning-llm prepare` ({err}); "
            "remove it or prepare the data again."
        ) from None
    if info.format != FORMAT:
        raise ValueError(
            f"{str(path)!r} has format {info.format!r}; this version reads {FORMAT!r}. Prepare the data "
            "again with this version's `lightning-llm prepare`."
        )
    return info


def read_offsets(token_file: str | Path) -> np.ndarray:
    """The document start offsets of ``token_file`` (memory-mapped ``.idx``, the total as last entry)."""
    path = offsets_path(token_file)
    if not path.is_file():
        raise FileNotFoundError(
            f"No document offsets {str(path)!r} next to {str(token_file)!r}; document ids need them. Write the token "
            "file with `lightning-llm prepare`, or set return_document_ids=False."
        )
    return np.memmap(path, dtype=np.uint64, mode="r")


def load_token_files(
    paths: list[str], token_dtype: str | None = None, with_offsets: bool = False
) -> tuple[np.ndarray, np.ndarray | None, TokenFileInfo | None]:
    """(tokens, document offsets or ``None``, combined sidecar or ``None``) of one or more token files.

    The dtype is ``token_dtype`` when given, else the sidecars' (else ``uint16``); a ``token_dtype`` that
    contradicts a sidecar is refused. Several files are concatenated; their offsets are shifted to match.

    Example::

        tokens, offsets, info = load_token_files(["data/train.bin"], with_offsets=True)
    """
    from lightning_llm.data.datasets import read_token_file
    from lightning_llm.data.token_scan import check_token_dtype

    infos = [read_token_info(p) for p in paths]
    described = [(p, i) for p, i in zip(paths, infos) if i is not None]
    for path, info in described:
        if token_dtype is not None and info.dtype != token_dtype:
            raise ValueError(
                f"token_dtype={token_dtype!r}, but the sidecar {str(sidecar_path(path))!r} says {path} holds "
                f"{info.dtype!r} tokens; drop token_dtype from the config (the sidecar sets it) or fix the sidecar."
            )
        if (info.dtype, info.eos_id) != (described[0][1].dtype, described[0][1].eos_id):
            raise ValueError(
                f"{path} ({info.dtype}, eos id {info.eos_id}) and {described[0][0]} ({described[0][1].dtype}, eos id "
                f"{described[0][1].eos_id}) were tokenized differently; use files prepared with one tokenizer."
            )
    dtype = token_dtype or (described[0][1].dtype if described else "uint16")
    arrays = [read_token_file(p, dtype) for p in paths]
    for (path, info), array in zip(zip(paths, infos), arrays):
        if info is not None and len(array) != info.num_tokens:
            raise ValueError(
                f"{path} holds {len(array)} tokens but its sidecar says {info.num_tokens}; the file was "
                "truncated or replaced. Prepare it again."
            )
        check_token_dtype(path, array, dtype, _said_by(path, token_dtype, info))
    tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    offsets = None
    if with_offsets:
        bases = np.cumsum([0] + [len(a) for a in arrays[:-1]])
        parts = [read_offsets(p)[:-1] for p in paths]
        parts = [part + np.uint64(base) if base else part for part, base in zip(parts, bases)]
        offsets = parts[0] if len(parts) == 1 else np.concatenate(parts)
    combined = None
    if described:
        first = described[0][1]
        combined = dataclasses.replace(
            first,
            vocab_size=max(i.vocab_size for _, i in described),
            num_documents=sum(i.num_documents for _, i in described),
            num_tokens=len(tokens),
        )
    return tokens, offsets, combined


def _said_by(path: str, token_dtype: str | None, info: TokenFileInfo | None) -> str:
    """Where the dtype a token file is read as came from, for an error's fix."""
    if token_dtype is not None:
        return f"token_dtype={token_dtype!r}"
    if info is not None:
        return f"as its sidecar {str(sidecar_path(path))!r} says"
    return "the default without a sidecar"


def check_ids_fit_sidecar(paths: list[str], info: TokenFileInfo | None, max_token_id: int) -> None:
    """Refuse token files holding an id beyond the vocabulary their own sidecars record (ids from other data, or a
    file read with the wrong dtype)."""
    if info is not None and max_token_id >= info.vocab_size:
        files, holds = (
            (f"{paths[0]} holds", "its sidecar says")
            if len(paths) == 1
            else (f"{', '.join(paths)} hold", "their sidecars say")
        )
        raise ValueError(
            f"{files} token id {max_token_id}, but {holds} vocab_size={info.vocab_size}: the data and the sidecar "
            "do not belong together (or token_dtype is wrong). Prepare the data again with `lightning-llm prepare`."
        )
