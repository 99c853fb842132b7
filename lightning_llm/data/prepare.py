"""``lightning-llm prepare``: tokenize local text into the token files ``LLMDataModule(source="tokens")`` reads.

Inputs are ``.txt`` and ``.jsonl`` files (the document rules are in :mod:`lightning_llm.data.documents`).
The tokenizer is a Hugging Face ``tokenizers`` ``tokenizer.json``, or, when none is given, a byte-level
BPE trained on the inputs and saved as ``tokenizer.json`` in the output folder (EOS ``<|endoftext|>``,
id 0). Encoding runs in ``workers`` processes, in chunks whose order is kept, so the bytes written do
not depend on the number of workers. Every ``1 / val_fraction``-th document (evenly spread, exactly
``floor(n * val_fraction)`` of ``n``) goes to ``val.bin``, the rest to ``train.bin``; each with its
sidecar and offsets (:mod:`lightning_llm.data.token_files`).

Example::

    lightning-llm prepare corpus/ --output_dir data --vocab_size 32000 --workers 8
    # data/train.bin data/train.json data/train.idx data/val.bin ... data/tokenizer.json
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Literal

import numpy as np

from lightning_llm.data.documents import expand_inputs, iter_documents
from lightning_llm.data.output_set import staged, swap_in
from lightning_llm.data.prepare_tokenizer import EOS_CANDIDATES, eos_id_of, load_or_train, recorded_name
from lightning_llm.data.prepare_tokenizer import train_bpe as train_bpe
from lightning_llm.data.token_files import TokenFileInfo, token_dtype_for, write_token_info
from lightning_llm.data.token_writer import TokenWriter, write_runs
from lightning_llm.validation import check_float, check_int

CHUNK_DOCUMENTS = 256

_worker_tokenizer = None


def prepare(
    inputs: list[str | Path],
    output_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    vocab_size: int = 32000,
    eos_token: str | None = None,
    text_key: str = "text",
    txt_split: Literal["file", "blank_line"] = "file",
    val_fraction: float = 0.0,
    workers: int = 1,
    progress: bool | None = None,
) -> dict[str, TokenFileInfo]:
    """Tokenize ``inputs`` into ``output_dir/train.bin`` (and ``val.bin`` when ``val_fraction > 0``).

    Arguments:
        inputs: ``.txt``/``.jsonl`` files or folders of them.
        output_dir: where the token files, sidecars, offsets (and a trained ``tokenizer.json``) go.
        tokenizer: a ``tokenizer.json``; ``None`` trains a byte-level BPE of ``vocab_size`` on the inputs.
        vocab_size: size of the trained tokenizer (at least 257: 256 bytes and EOS).
        eos_token: the separator token of a given tokenizer (default: the first of
            ``EOS_CANDIDATES`` it has, :mod:`lightning_llm.data.prepare_tokenizer`).
        text_key: the key of a JSON Lines record that holds the text.
        txt_split: ``"file"`` (a ``.txt`` file is one document) or ``"blank_line"``.
        val_fraction: share of documents (every ``1 / val_fraction``-th) written to ``val.bin``.
        workers: encoding processes.
        progress: show a progress bar (``None``: when stderr is a terminal).

    Returns the written files' sidecars by split name.

    Example::

        infos = prepare(["notes.txt"], "data", vocab_size=512)
        print(infos["train"].num_tokens)
    """
    out = _output_folder(inputs, output_dir, val_fraction, workers)

    def documents() -> Iterator[str]:
        return iter_documents(inputs, text_key=text_key, txt_split=txt_split)

    _refuse_no_documents(inputs, documents)
    with staged(out) as stage:  # the previous run's files stay as they were until this one has succeeded
        tok, tokenizer_path = load_or_train(tokenizer, vocab_size, documents, stage)
        eos_id = eos_id_of(tok, tokenizer_path, eos_token)
        names = ("train", "val") if val_fraction > 0 else ("train",)
        dtype = token_dtype_for(tok.get_vocab_size(with_added_tokens=True))
        writers = {name: TokenWriter(stage / f"{name}.bin", dtype) for name in names}
        write_runs(_encode(tok, eos_id, _assign_splits(documents(), val_fraction), workers), writers, progress)
        _refuse_empty_validation(writers, val_fraction)
        infos = _write_sidecars(writers, tok, eos_id, recorded_name(tokenizer_path, stage, out))
        swap_in(stage, out, names)
    return infos


def _write_sidecars(writers: dict[str, TokenWriter], tok, eos_id: int, tokenizer: str) -> dict[str, TokenFileInfo]:
    """Describe each written split in its sidecar (:func:`~lightning_llm.data.token_files.write_token_info`)."""
    infos = {
        name: TokenFileInfo(
            dtype=str(w.dtype),
            vocab_size=tok.get_vocab_size(with_added_tokens=True),
            eos_id=eos_id,
            tokenizer=tokenizer,
            num_documents=w.documents,
            num_tokens=w.tokens,
        )
        for name, w in writers.items()
    }
    for name, info in infos.items():
        write_token_info(writers[name].path, info)
    return infos


def _output_folder(inputs: list[str | Path], output_dir: str | Path, val_fraction: float, workers: int) -> Path:
    """``output_dir``, created; arguments that cannot work are refused first, before a tokenizer is trained."""
    check_int("workers", workers, minimum=1, hint="encoding processes, e.g. the number of CPU cores")
    check_float("val_fraction", val_fraction, minimum=0, maximum=1, hint="the share of documents held out, below 1")
    if val_fraction >= 1:
        raise ValueError(f"val_fraction={val_fraction!r} must be below 1 (the share of documents held out).")
    expand_inputs(inputs)  # missing files and bad suffixes
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output_dir={str(out)!r} is a file, not a folder; choose a folder for the token files.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in the way, no permission, a read-only disk
        raise ValueError(f"output_dir={str(out)!r} cannot be used as a folder: {err.strerror or err}.") from None
    return out


def _refuse_no_documents(inputs: list[str | Path], documents: Callable[[], Iterator[str]]) -> None:
    if next(documents(), None) is None:
        raise ValueError(
            f"No documents in {[str(p) for p in inputs]}: every file is empty or whitespace only "
            "(or, for .jsonl, every record's text is). Give inputs with some text."
        )


def _refuse_empty_validation(writers: dict[str, TokenWriter], val_fraction: float) -> None:
    if "val" in writers and writers["val"].documents == 0:
        total = writers["train"].documents
        raise ValueError(
            f"val_fraction={val_fraction} of {total} documents is 0 documents; use --val_fraction 0 "
            f"(no validation split) or at least {1 / total:.3g}."
        )


def _assign_splits(documents: Iterable[str], val_fraction: float) -> Iterator[tuple[str, str]]:
    """(split, document): document ``i`` is held out when ``floor((i + 1) * f) > floor(i * f)``."""
    for index, doc in enumerate(documents):
        held_out = math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)
        yield ("val" if held_out else "train"), doc


def _encode(tok, eos_id: int, docs: Iterator[tuple[str, str]], workers: int):
    """(split, document lengths, tokens) per run of same-split documents, in input order."""
    chunks = iter(lambda: list(islice(docs, CHUNK_DOCUMENTS)), [])
    # One process per worker, each encoding sequentially: --workers is the parallelism, and forked workers do
    # not inherit the tokenizer's thread pool (its fork warning stays quiet once the variable is set).
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        if workers == 1:
            _init_worker(tok.to_str(), eos_id)
            yield from (run for chunk in chunks for run in _encode_chunk(chunk))
            return
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        with context.Pool(workers, initializer=_init_worker, initargs=(tok.to_str(), eos_id)) as pool:
            for runs in pool.imap(_encode_chunk, chunks):
                yield from runs
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _init_worker(tokenizer_json: str, eos_id: int) -> None:
    from tokenizers import Tokenizer

    global _worker_tokenizer
    _worker_tokenizer = (Tokenizer.from_str(tokenizer_json), eos_id)


def _encode_chunk(chunk: list[tuple[str, str]]) -> list[tuple[str, list[int], np.ndarray]]:
    tok, eos_id = _worker_tokenizer
    # No special tokens added (no BOS): documents are the text's own ids, each followed by EOS.
    encodings = tok.encode_batch([doc for _, doc in chunk], add_special_tokens=False)
    runs: list[tuple[str, list[int], list[int]]] = []
    for (split, _), encoding in zip(chunk, encodings):
        if not runs or runs[-1][0] != split:
            runs.append((split, [], []))
        runs[-1][1].append(len(encoding.ids) + 1)
        runs[-1][2].extend(encoding.ids)
        runs[-1][2].append(eos_id)
    return [(split, lengths, np.asarray(ids, dtype=np.int64)) for split, lengths, ids in runs]


def command(args: list[str]) -> dict[str, TokenFileInfo]:
    """``lightning-llm prepare``: parse the flags, run :func:`prepare`, print one line per written file."""
    parser = argparse.ArgumentParser(
        prog="lightning-llm prepare",
        description="Tokenize local .txt/.jsonl files into the token files LLMDataModule(source='tokens') reads.",
    )
    parser.add_argument("inputs", nargs="+", help=".txt / .jsonl files or folders of them")
    parser.add_argument("--output_dir", required=True, help="folder for train.bin/.json/.idx, val.* and tokenizer.json")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: train a byte-level BPE)")
    parser.add_argument("--vocab_size", type=int, default=32000, help="size of the trained BPE (default 32000)")
    parser.add_argument("--eos_token", help=f"document separator of --tokenizer (default: first of {EOS_CANDIDATES})")
    parser.add_argument("--text_key", default="text", help="key of the text in .jsonl records (default: text)")
    parser.add_argument(
        "--txt_split",
        choices=("file", "blank_line"),
        default="file",
        help="a .txt file is one document (file), or documents are separated by blank lines",
    )
    parser.add_argument("--val_fraction", type=float, default=0.0, help="share of documents written to val.bin")
    parser.add_argument("--workers", type=int, default=1, help="encoding processes (default 1)")
    options = parser.parse_args(args)
    try:
        infos = prepare(
            options.inputs,
            options.output_dir,
            tokenizer=options.tokenizer,
            vocab_size=options.vocab_size,
            eos_token=options.eos_token,
            text_key=options.text_key,
            txt_split=options.txt_split,
            val_fraction=options.val_fraction,
            workers=options.workers,
        )
    except (FileNotFoundError, TypeError, ValueError) as err:
        parser.error(str(err))
    for name, info in infos.items():
        print(
            f"{Path(options.output_dir) / name}.bin: {info.num_documents} documents, {info.num_tokens} tokens "
            f"({info.dtype}, vocab {info.vocab_size}, eos {info.eos_id}, tokenizer {info.tokenizer})"
        )
    return infos
