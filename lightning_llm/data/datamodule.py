"""LLMDataModule: the embedded synthetic corpus, plain text files, or memory-mapped token files."""

from __future__ import annotations

from typing import Literal

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from lightning_llm.data.datasets import TokenWindows, read_text_files
from lightning_llm.data.model_limits import check_data_fits_model
from lightning_llm.data.packing import PackedDocuments, split_offsets
from lightning_llm.data.sampler import ResumableDistributedSampler
from lightning_llm.data.synthetic import entropy_floor, markov_corpus
from lightning_llm.data.token_files import TokenFileInfo, check_ids_fit_sidecar, load_token_files
from lightning_llm.data.token_scan import CHUNK, SCAN_LIMIT, max_token
from lightning_llm.data.tokenizer import ByteTokenizer
from lightning_llm.validation import check_bool, check_choice, check_float, check_int

SOURCES = ("synthetic", "text", "tokens")


class LLMDataModule(L.LightningDataModule):
    """Fixed-length token windows for next-token prediction, sharded over data-parallel ranks.

    Sources:

    * ``"synthetic"`` (default): a seeded Markov chain shipped as code, no download; its loss
      floor is ``log(branching)`` nats (see :mod:`lightning_llm.data.synthetic`).
    * ``"text"``: UTF-8 text files, byte-level tokenized (vocabulary 256).
    * ``"tokens"``: flat binary files of ``uint16``/``uint32`` token ids, memory-mapped, as written by
      ``lightning-llm prepare`` (documents separated by EOS, packed into windows without padding). Its
      JSON sidecar sets ``token_dtype``, and its vocabulary, EOS id and tokenizer are its ``token_info``.

    The last ``val_fraction`` of a file source is the validation split, unless ``val_path`` names
    validation files (``val.bin`` of ``lightning-llm prepare --val_fraction``). With
    ``return_document_ids=True`` (``"tokens"`` with the ``.idx`` offsets ``prepare`` writes) batches are
    dicts ``{"input_ids": (batch, seq_len + 1), "document_ids": (batch, seq_len + 1)}``: the keys of a
    Hugging Face batch, ``input_ids`` shifted by the model as without document ids, and document ids
    numbered from 0 in each sample for a document-masked attention
    (:func:`~lightning_llm.data.packing.document_causal_mask`; :class:`~lightning_llm.models.CausalLM`
    uses it). Data-parallel rank and
    size come from the Trainer's strategy (``distributed_sampler_kwargs``), so tensor- and
    pipeline-parallel ranks of one replica read the same batches. Shuffling is seeded by
    ``seed`` and the epoch; the position within an epoch is saved in checkpoints, so a resumed
    run continues with the next batch.

    Arguments:
        source: ``"synthetic"``, ``"text"`` or ``"tokens"``.
        path: file or list of files for ``"text"``/``"tokens"``.
        val_path: file or list of files for validation (the same source); ``val_fraction`` is then unused.
        seq_len: tokens per sample (each sample holds ``seq_len + 1`` tokens: inputs and shifted targets).
        batch_size: samples per batch on each data-parallel rank.
        token_dtype: ``"uint16"`` or ``"uint32"`` for ``"tokens"`` files; ``None`` (default) reads it from
            the sidecar, else ``"uint16"``.
        val_fraction: share of a file source held out for validation.
        num_tokens: size of the synthetic training corpus.
        vocab_size: vocabulary of the synthetic corpus.
        markov_order: context length of the synthetic chain.
        branching: successors per context of the synthetic chain.
        seed: corpus and shuffling seed.
        shuffle: shuffle training samples each epoch.
        num_workers: DataLoader worker processes.
        return_document_ids: batches are dicts with per-position document ids (``"tokens"`` only).

    Example::

        data = LLMDataModule(source="tokens", path="data/train.bin", val_path="data/val.bin", seq_len=2048)
    """

    def __init__(
        self,
        source: Literal["synthetic", "text", "tokens"] = "synthetic",
        path: str | list[str] | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        token_dtype: Literal["uint16", "uint32"] | None = None,
        val_fraction: float = 0.05,
        num_tokens: int = 1_000_000,
        vocab_size: int = 256,
        markov_order: int = 1,
        branching: int = 4,
        seed: int = 42,
        shuffle: bool = True,
        num_workers: int = 0,
        val_path: str | list[str] | None = None,
        return_document_ids: bool = False,
    ) -> None:
        super().__init__()
        _check_source(source, path)
        _check_samples(seq_len, batch_size, token_dtype, val_fraction)
        _check_synthetic_corpus(num_tokens, vocab_size, markov_order, branching)
        _check_loading(seed, shuffle, num_workers)
        _validate_files(source, val_path, return_document_ids)
        self.save_hyperparameters()
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self._resume: tuple[int, int] | None = None
        self._train_sampler: ResumableDistributedSampler | None = None
        self.max_token_id: int | None = None
        self.token_info: TokenFileInfo | None = None

    @property
    def entropy_floor(self) -> float | None:
        """Lowest achievable loss (nats/token) of the synthetic corpus; ``None`` for file sources."""
        return entropy_floor(self.hparams.branching) if self.hparams.source == "synthetic" else None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            train, val = self._load_tokens()
            # One pass over the tokens (memory-mapped files in chunks; a sample past SCAN_LIMIT), once: far
            # cheaper than the IndexError or device assert an out-of-vocabulary id causes in the first forward.
            self.max_token_id = max(_max_token(train[0]), _max_token(val[0]))
            if self.hparams.source == "tokens":
                check_ids_fit_sidecar(_as_list(self.hparams.path), self.token_info, self.max_token_id)
            self.train_set, self.val_set = (self._windows(*split) for split in (train, val))
        trainer = self.trainer
        if trainer is not None and trainer.lightning_module is not None:  # the model's limits, before the first step
            check_data_fits_model(trainer.lightning_module, self.max_token_id, self.hparams.seq_len, self._files())

    def _files(self) -> str | None:
        """The data's files and dtype, for an error to name (``None`` for the synthetic corpus)."""
        if self.hparams.source == "synthetic":
            return None
        names = ", ".join(_as_list(self.hparams.path) + _as_list(self.hparams.val_path))
        dtype = self.hparams.token_dtype or (self.token_info.dtype if self.token_info else "uint16")
        return names if self.hparams.source == "text" else f"{names} (read as {dtype})"

    @property
    def vocab_size(self) -> int | None:
        """The data's vocabulary: the synthetic corpus's, 256 for text, the sidecar's for token files (after setup)."""
        if self.hparams.source == "synthetic":
            return self.hparams.vocab_size
        if self.hparams.source == "text":
            return ByteTokenizer.vocab_size
        return self.token_info.vocab_size if self.token_info is not None else None

    def _windows(self, tokens: np.ndarray, offsets: np.ndarray | None) -> TokenWindows:
        if offsets is None:
            return TokenWindows(tokens, self.hparams.seq_len)
        return PackedDocuments(tokens, self.hparams.seq_len, offsets)

    def _load_tokens(self) -> tuple[tuple[np.ndarray, np.ndarray | None], tuple[np.ndarray, np.ndarray | None]]:
        """(tokens, document offsets or None) of the training and the validation split."""
        hp = self.hparams
        if hp.source == "synthetic":
            chain = dict(vocab_size=hp.vocab_size, order=hp.markov_order, branching=hp.branching, seed=hp.seed)
            num_val = max(int(hp.num_tokens * hp.val_fraction), hp.seq_len + 1)
            train, val = markov_corpus(hp.num_tokens, stream=0, **chain), markov_corpus(num_val, stream=1, **chain)
            return (train, None), (val, None)
        paths, val_paths = _as_list(hp.path), _as_list(hp.val_path)
        if hp.source == "text":
            tokens, offsets = read_text_files(paths, ByteTokenizer().encode), None
            val = (read_text_files(val_paths, ByteTokenizer().encode), None) if val_paths else None
        else:
            tokens, offsets, self.token_info = load_token_files(paths, hp.token_dtype, hp.return_document_ids)
            dtype = hp.token_dtype or (self.token_info.dtype if self.token_info else None)
            val = load_token_files(val_paths, dtype, hp.return_document_ids)[:2] if val_paths else None
        if val is not None:
            return (tokens, offsets), val
        split = int(len(tokens) * (1 - hp.val_fraction))
        if offsets is None:
            return (tokens[:split], None), (tokens[split:], None)
        train_offsets, val_offsets = split_offsets(offsets, 0, split), split_offsets(offsets, split, len(tokens))
        return (tokens[:split], train_offsets), (tokens[split:], val_offsets)

    def _sampler(self, dataset, shuffle: bool) -> ResumableDistributedSampler:
        kwargs = {"num_replicas": 1, "rank": 0}
        if self.trainer is not None:
            kwargs.update(self.trainer.distributed_sampler_kwargs or {})
        return ResumableDistributedSampler(
            dataset, num_replicas=kwargs["num_replicas"], rank=kwargs["rank"], shuffle=shuffle, seed=self.hparams.seed
        )

    def _loader(self, dataset, sampler) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            sampler=sampler,
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )

    def train_dataloader(self) -> DataLoader:
        self._train_sampler = self._sampler(self.train_set, self.hparams.shuffle)
        if self._resume is not None:
            epoch, global_samples = self._resume
            replicas = self._train_sampler.num_replicas
            if global_samples % replicas:
                raise ValueError(
                    f"The checkpoint consumed {global_samples} samples, which {replicas} data-parallel ranks cannot "
                    "split evenly; resume with a data-parallel size that divides it."
                )
            # Kept (not cleared): a second train_dataloader() call, e.g. a strategy reading one batch
            # ahead of training, must not lose the position. It applies to that epoch only.
            self._train_sampler.resume(epoch, global_samples // replicas)
        return self._loader(self.train_set, self._train_sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self._sampler(self.val_set, shuffle=False))

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def state_dict(self) -> dict:
        """Where training stands: the epoch and the samples all data-parallel ranks consumed in it.

        Counting globally lets a run resume with a different number of data-parallel ranks.
        """
        if self.trainer is None or self._train_sampler is None:
            return {}
        # The sampler's epoch, not trainer.current_epoch: the latter moves on when fit() stops mid-epoch.
        batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready
        samples = batches * self.hparams.batch_size * self._train_sampler.num_replicas
        return {"epoch": self._train_sampler.epoch, "global_samples": samples}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            self._resume = (state_dict["epoch"], state_dict["global_samples"])


def _max_token(tokens: np.ndarray, chunk: int = CHUNK, limit: int = SCAN_LIMIT) -> int:
    """The largest token id in ``tokens``, read in chunks; past ``limit`` tokens, from evenly spaced chunks only."""
    return max_token(tokens, chunk, limit)


def _as_list(paths: str | list[str] | None) -> list[str]:
    return [] if paths is None else [paths] if isinstance(paths, str) else list(paths)


def _validate_files(source: str, val_path, return_document_ids: bool) -> None:
    check_bool("return_document_ids", return_document_ids)
    if return_document_ids and source != "tokens":
        raise ValueError(
            f"return_document_ids=True needs source='tokens' (files from `lightning-llm prepare` with their "
            f".idx document offsets), got source={source!r}."
        )
    if val_path is not None:
        if source == "synthetic":
            raise ValueError(
                f"val_path={val_path!r} is for file sources; source='synthetic' draws its own validation "
                "stream. Set source='tokens' or 'text', or drop val_path."
            )
        paths = _as_list(val_path)
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise ValueError(f"val_path={val_path!r} must be a file or a list of files.")


def _check_source(source, path) -> None:
    """Refuse an unknown ``source``, or a ``path`` that does not go with it."""
    check_choice(
        "source",
        source,
        SOURCES,
        hint="parquet, JSON and the like: tokenize to a uint16/uint32 file and use source='tokens'",
    )
    if source == "synthetic" and path is not None:
        raise ValueError(
            f"path={path!r} is for file sources; source='synthetic' generates its own tokens. Set source='tokens' "
            "(files from `lightning-llm prepare`) or 'text', or drop path."
        )
    if source in ("text", "tokens"):
        paths = [path] if isinstance(path, str) else path
        if not paths or not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) and p for p in paths):
            raise ValueError(f"source={source!r} needs `path` (a file or a list of files), got path={path!r}.")


def _check_samples(seq_len, batch_size, token_dtype, val_fraction) -> None:
    """Refuse sample and batch shapes, token widths and validation shares that cannot work."""
    check_int("seq_len", seq_len, minimum=1, hint="tokens per sample, e.g. 2048")
    check_int("batch_size", batch_size, minimum=1)
    if token_dtype is not None:
        check_choice("token_dtype", token_dtype, ("uint16", "uint32"), hint="or None to read it from the sidecar")
    check_float("val_fraction", val_fraction, minimum=0, maximum=1, inclusive=False)


def _check_synthetic_corpus(num_tokens, vocab_size, markov_order, branching) -> None:
    """Refuse a synthetic Markov corpus that cannot be generated."""
    check_int("num_tokens", num_tokens, minimum=2)
    check_int("vocab_size", vocab_size, minimum=1, maximum=2**32)
    check_int("markov_order", markov_order, minimum=1)
    check_int("branching", branching, minimum=1, maximum=vocab_size, hint="at most vocab_size successors per context")


def _check_loading(seed, shuffle, num_workers) -> None:
    """Refuse a seed, shuffle flag or worker count the DataLoader cannot take."""
    check_int("seed", seed, minimum=0)
    check_bool("shuffle", shuffle)
    check_int("num_workers", num_workers, minimum=0)
