"""``prepare``'s tokenizer: a given ``tokenizer.json`` or a byte-level BPE trained on the inputs, its EOS id, and
the name the token files' sidecars record for it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from lightning_llm.validation import check_int

TRAINED_EOS = "<|endoftext|>"
# Looked up in a given tokenizer when no --eos_token is named (GPT-2/Llama-3, Llama-2/Mistral, Gemma, Llama-3 base).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def load_or_train(given: str | Path | None, vocab_size: int, documents: Callable[[], Iterator[str]], out: Path):
    """(tokenizer, its resolved path): ``given`` read, or, when ``None``, a BPE of ``vocab_size`` trained on
    ``documents()`` and saved as ``out/tokenizer.json``."""
    from tokenizers import Tokenizer

    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(
                f"Tokenizer not found: tokenizer={str(path)!r}. Pass a Hugging Face tokenizer.json "
                "file, or leave --tokenizer out to train a byte-level BPE on the inputs."
            )
        try:
            return Tokenizer.from_file(str(path)), path.resolve()
        except Exception as err:  # the Rust side raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer={str(path)!r} is not a Hugging Face tokenizer.json ({err}).") from None
    check_int("vocab_size", vocab_size, minimum=257, maximum=2**32, hint="256 byte tokens plus EOS at least")
    tok = train_bpe(documents(), vocab_size)
    path = (out / "tokenizer.json").resolve()
    tok.save(str(path))
    return tok, path


def train_bpe(documents: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style, no prefix space, so decoding gives the text back exactly) with EOS id 0.

    Example::

        tok = train_bpe(["hello world", "hello there"], vocab_size=300)
        assert tok.decode(tok.encode("hello").ids) == "hello"
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def eos_id_of(tok, path: Path, eos_token: str | None) -> int:
    """The id of ``eos_token`` in ``tok``, or of the first of :data:`EOS_CANDIDATES` it has; refused, naming the
    tokenizer's special tokens, when there is none."""
    names = [eos_token] if eos_token is not None else list(EOS_CANDIDATES)
    for name in names:
        if (found := tok.token_to_id(name)) is not None:
            return found
    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    if eos_token is not None:
        raise ValueError(
            f"eos_token={eos_token!r} is not in the tokenizer {str(path)!r}; its special tokens are "
            f"{added}. Pass one of them with --eos_token."
        )
    raise ValueError(
        f"The tokenizer {str(path)!r} has none of {list(EOS_CANDIDATES)}; its special tokens are {added}. "
        "Name the document separator with --eos_token."
    )


def recorded_name(tokenizer_path: Path, stage: Path, out: Path) -> str:
    """The tokenizer as the sidecar names it: beside the token files when trained (or given from ``out``)."""
    if tokenizer_path.parent == stage.resolve():
        return tokenizer_path.name
    if tokenizer_path.is_relative_to(out.resolve()):
        return os.path.relpath(tokenizer_path, out.resolve())
    return str(tokenizer_path)
