"""Documents of local text corpora: ``.txt`` files and JSON Lines, read lazily in a fixed order.

* ``.txt``: with ``txt_split="file"`` (default) a file is one document, its text unchanged. With
  ``txt_split="blank_line"`` documents are the runs of text between blank lines (a line holding only
  whitespace; several in a row count as one), each without its leading and trailing newlines (the
  indentation of its first line stays).
* ``.jsonl``: one JSON object per line, the document is ``object[text_key]``; blank lines are skipped.

Documents that are empty or whitespace only are skipped (a tokenizer gives them no tokens). A
directory stands for the ``.txt``/``.jsonl`` files under it, sorted by path.

Example::

    for doc in iter_documents(["corpus/"], text_key="text"):
        print(len(doc))
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

SUFFIXES = (".txt", ".jsonl")
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n(?:[ \t\r\f\v]*\n)*")


def expand_inputs(inputs: list[str | Path]) -> list[Path]:
    """The files named by ``inputs`` (directories expanded to their ``.txt``/``.jsonl`` files), checked to exist.

    Example::

        expand_inputs(["a.txt", "shards/"])  # [Path("a.txt"), Path("shards/0.jsonl"), ...]
    """
    if not inputs:
        raise ValueError("No input files given; name at least one .txt or .jsonl file (or a directory of them).")
    files: list[Path] = []
    for entry in map(Path, inputs):
        if entry.is_dir():
            found = sorted(p for p in entry.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise ValueError(f"Input directory {str(entry)!r} holds no {' or '.join(SUFFIXES)} files.")
            files += found
        elif not entry.is_file():
            raise FileNotFoundError(f"Input file not found: {str(entry)!r}. Check the path (relative to {Path.cwd()}).")
        elif entry.suffix not in SUFFIXES:
            raise ValueError(
                f"Input {str(entry)!r} has suffix {entry.suffix!r}; supported are {', '.join(SUFFIXES)} "
                '(convert other formats to JSON Lines with one {"text": ...} object per line).'
            )
        else:
            files.append(entry)
    return files


def iter_documents(
    inputs: list[str | Path], text_key: str = "text", txt_split: Literal["file", "blank_line"] = "file"
) -> Iterator[str]:
    """Every non-empty document of ``inputs``, file by file, in order (see the module docstring for the rules)."""
    if txt_split not in ("file", "blank_line"):
        raise ValueError(f"txt_split={txt_split!r} is not supported; use 'file' or 'blank_line'.")
    for path in expand_inputs(inputs):
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, text_key)
            continue
        text = _read_utf8(path)
        parts = [text] if txt_split == "file" else [p.strip("\n") for p in _BLANK_LINE.split(text)]
        yield from (p for p in parts if p.strip())


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{str(path)!r} is not UTF-8 (byte {err.object[err.start]:#04x} at offset {err.start}); convert it, "
            "e.g. `iconv -t UTF-8`."
        ) from None


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(_utf8_lines(lines, path), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"Line {number} of {str(path)!r} is not valid JSON ({err.msg}).") from None
            if not isinstance(record, dict) or text_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"Line {number} of {str(path)!r} has no key text_key={text_key!r} (it has {keys}); pass "
                    "--text_key with the key that holds the document text."
                )
            text = record[text_key]
            if not isinstance(text, str):
                raise ValueError(
                    f"Line {number} of {str(path)!r}: text_key={text_key!r} holds a {type(text).__name__}, not a "
                    "string; pass --text_key with the key that holds the document text."
                )
            if text.strip():
                yield text


def _utf8_lines(lines, path: Path) -> Iterator[str]:
    try:
        yield from lines
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{str(path)!r} is not UTF-8 ({err.reason} at byte {err.start} of a read block); convert "
            "it, e.g. `iconv -t UTF-8`."
        ) from None
