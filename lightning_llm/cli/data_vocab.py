"""The model's vocabulary from the data: ``fit`` on ``prepare``'s token files sizes a preset model to their tokenizer.

``lightning-llm prepare`` writes the tokenizer's vocabulary into each token file's sidecar
(``train.json``). A preset names a vocabulary of its own (``tiny``: 256 bytes, ``7B``: Llama-2's 32000); training
a preset on files of another tokenizer would either refuse (ids past the embedding) or waste embedding rows. So,
as Hugging Face sizes a model to its tokenizer, a model configured by a preset name takes the sidecar's
vocabulary and says so; a config the user wrote out in full (``--model.init_args.config.vocab_size N``) is kept
as written, and the data module's check still refuses ids it cannot embed.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from lightning_llm.data import LLMDataModule
from lightning_llm.data.token_files import read_token_info, sidecar_path
from lightning_llm.models import CausalLM


def adopt_data_vocabulary(model, datamodule, configured) -> str | None:
    """Give a preset-configured :class:`CausalLM` the vocabulary of ``prepare``'s sidecar; return what was done.

    ``configured`` is the model's ``config`` argument as parsed (a preset name, or a full config the user wrote).

    Example::

        adopt_data_vocabulary(CausalLM("tiny"), LLMDataModule(source="tokens", path="data/train.bin"), "tiny")
        # "model vocab_size 256 -> 1024 from data/train.json ..."
    """
    if not (isinstance(model, CausalLM) and isinstance(datamodule, LLMDataModule)) or not isinstance(configured, str):
        return None
    if datamodule.hparams.source != "tokens" or model.model is not None:
        return None
    path = datamodule.hparams.path
    first = path[0] if isinstance(path, (list, tuple)) else path
    info = read_token_info(first) if first is not None else None
    if info is None or info.vocab_size == model.config.vocab_size:
        return None
    before = model.config.vocab_size
    model.config = dataclasses.replace(model.config, vocab_size=info.vocab_size)
    # A checkpoint's hyperparameters rebuild the model that trained: as a dict, the form jsonargparse re-parses (a
    # LightningCLI checkpoint goes through it) and CausalLM takes.
    model.hparams["config"] = dataclasses.asdict(model.config)
    message = (
        f"model vocab_size {before} -> {info.vocab_size}, from {sidecar_path(first)} (the tokenizer `prepare` "
        f"used; preset {configured!r} has {before}). To choose the size yourself: "
        "--model.init_args.config.vocab_size N."
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr)
    return message
