"""Checks that need the model, the data and the Trainer together, run before the first training step.

They catch what would otherwise fail late or not at all: token ids beyond the model's vocabulary
(an IndexError deep in the first forward, or under tensor parallelism "Target 360 is out of
bounds"), sequences longer than the model's ``max_seq_len`` (silently trained past the rotary
tables' range), and a ``ckpt_path`` that is not a checkpoint this Trainer can read.

Example::

    check_data_fits_model(module, max_token_id=31999, seq_len=2048)
"""

from __future__ import annotations

from pathlib import Path

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
        length = next((getattr(config, name) for name in ("max_seq_len", "max_position_embeddings", "n_positions")
                       if isinstance(getattr(config, name, None), int)), None)
        if isinstance(vocab, int) or length is not None:
            return (vocab if isinstance(vocab, int) else None), length
    return None, None


def check_data_fits_model(module: L.LightningModule, max_token_id: int | None, seq_len: int) -> None:
    """Refuse data whose token ids or sequence length the model cannot take."""
    vocab, longest = model_limits(module)
    name = type(module).__name__
    if vocab is not None and max_token_id is not None and max_token_id >= vocab:
        raise ValueError(
            f"The data holds token id {max_token_id}, but {name} has a vocabulary of {vocab} (ids 0..{vocab - 1}). "
            "Use the tokenizer the model was built for, or a model with vocab_size > "
            f"{max_token_id} (for the synthetic corpus, data vocab_size <= {vocab})."
        )
    if longest is not None and seq_len > longest:
        raise ValueError(
            f"seq_len={seq_len} is longer than {name}'s max_seq_len={longest}. Use seq_len <= {longest}, or a model "
            "configured for longer sequences."
        )


def check_checkpoint_path(ckpt_path: str | Path | None, strategy) -> None:
    """Refuse a ``ckpt_path`` directory that is not a checkpoint, or one this strategy cannot read.

    Sharded (DCP) directories are read by Lightning's ModelParallel and FSDP strategies (and so
    LLMParallelStrategy); DeepSpeed directories have their own layout and are left to DeepSpeed.
    Files and names ("last", "best") are Lightning's to resolve. ``lightning-llm fit`` runs it before
    fitting; Lightning's own Trainer gives user code no hook between ``fit(ckpt_path=...)`` and the load.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_llm.callbacks import checkpoint_fs as cfs

    if ckpt_path is None or ckpt_path in ("last", "best", "hpc") or isinstance(strategy, DeepSpeedStrategy):
        return
    path = str(ckpt_path)  # a local path or an fsspec URL (ValueError naming an unknown protocol)
    if not cfs.isdir(path):
        return
    sharded_loader = isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))
    if not cfs.isfile(cfs.join(path, ".metadata")):
        raise ValueError(
            f"ckpt_path={path!r} is a directory but not a checkpoint (no .metadata file inside). Pass a "
            "checkpoint file or a sharded checkpoint directory saved by LLMParallelStrategy."
        )
    if not sharded_loader:
        raise ValueError(
            f"ckpt_path={path!r} is a sharded checkpoint directory, which this Trainer's strategy cannot "
            "load. Resume with strategy=LLMParallelStrategy(...) (any number of devices), or first write one file "
            f"with `python -m lightning_llm.checkpoint {path} full.ckpt`."
        )
