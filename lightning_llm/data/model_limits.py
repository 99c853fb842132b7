"""Does the data fit the model? Checked before the first training step.

It catches what would otherwise fail late or not at all: token ids beyond the model's vocabulary
(an IndexError deep in the first forward, or under tensor parallelism "Target 360 is out of
bounds") and sequences longer than the model's ``max_seq_len`` (silently trained past the rotary
tables' range).

Example::

    check_data_fits_model(module, max_token_id=31999, seq_len=2048)
"""

from __future__ import annotations

import lightning as L


def model_limits(module: L.LightningModule) -> tuple[int | None, int | None]:
    """(vocabulary size, longest sequence) of a model, from its config; ``None`` where it declares none.

    Reads ``module.config`` (lightning_llm's :class:`~lightning_llm.models.LlamaConfig`) or a Hugging
    Face ``config`` on the module or its ``model`` (``vocab_size``, ``max_position_embeddings`` /
    ``n_positions``). A model with neither is not checked.
    """
    for owner in (module, getattr(module, "model", None)):
        config = getattr(owner, "config", None)
        if config is None:
            continue
        vocab = getattr(config, "vocab_size", None)
        length = next(
            (
                getattr(config, name)
                for name in ("max_seq_len", "max_position_embeddings", "n_positions")
                if isinstance(getattr(config, name, None), int)
            ),
            None,
        )
        if isinstance(vocab, int) or length is not None:
            return (vocab if isinstance(vocab, int) else None), length
    return None, None


def check_data_fits_model(
    module: L.LightningModule, max_token_id: int | None, seq_len: int, files: str | None = None
) -> None:
    """Refuse data whose token ids or sequence length the model cannot take; ``files`` names the data's files."""
    vocab, longest = model_limits(module)
    name = type(module).__name__
    if vocab is not None and max_token_id is not None and max_token_id >= vocab:
        # A uint16 file read as uint32 pairs two ids into one: far past any vocabulary.
        dtype = " If the files hold 16-bit ids, set token_dtype='uint16'." if "uint32" in (files or "") else ""
        raise ValueError(
            f"The data{f' ({files})' if files else ''} holds token id {max_token_id}, but {name} has a vocabulary of "
            f"{vocab} (ids 0..{vocab - 1}). Use the tokenizer the model was built for, or a model with vocab_size > "
            f"{max_token_id} (for the synthetic corpus, data vocab_size <= {vocab}).{dtype}"
        )
    if longest is not None and seq_len > longest:
        raise ValueError(
            f"seq_len={seq_len} is longer than {name}'s max_seq_len={longest}. Use seq_len <= {longest}, or a model "
            "configured for longer sequences."
        )
