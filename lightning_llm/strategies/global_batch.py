"""The global batch a run trains on, per optimizer step, and the one line on rank 0 that states it."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_llm.data.batch import batch_tokens
from lightning_llm.strategies.parallel_options import StrategyOptions
from lightning_llm.strategies.run_state import RunState


def global_batch(trainer, options: StrategyOptions, state: RunState) -> tuple[int | None, int | None]:
    """(sequences, tokens) per optimizer step: micro-batch × data-parallel size × accumulate_grad_batches (× seq_len).

    The micro-batch and sequence length come from the strategy's ``micro_batch_size``/``seq_len``, else the
    datamodule's ``batch_size``/``seq_len`` hyperparameters; None where neither says.
    """
    hparams = trainer.datamodule.hparams if trainer.datamodule is not None else {}
    micro_batch = options.planning.micro_batch_size or hparams.get("batch_size")
    seq_len = options.planning.seq_len or hparams.get("seq_len")
    if not micro_batch:
        return None, None
    sequences = int(micro_batch) * state.parallel_dims.dp * int(trainer.accumulate_grad_batches)
    return sequences, sequences * int(seq_len) if seq_len else None


def log_global_batch(trainer, options: StrategyOptions, state: RunState, batch: Any = None) -> None:
    """One line on rank 0 when fitting: the global batch in sequences and tokens. Where neither the strategy's
    options nor the datamodule say the micro-batch (a plain DataLoader), it is read off the first batch instead:
    called again then with ``batch`` (:meth:`LLMParallelStrategy.on_train_batch_start`)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return
    sequences, tokens = global_batch(trainer, options, state)
    dp, accumulate = state.parallel_dims.dp, int(trainer.accumulate_grad_batches)
    if sequences is None and batch is None:
        state.batch_line_pending = True
        return
    if sequences is None:
        state.batch_line_pending = False
        try:
            samples, _ = batch_tokens(batch, shifted_targets=False)
        except TypeError:  # not a (batch, seq_len) tensor or a dict of them: nothing to count
            return
        length = _sequence_length(batch)
        sequences = samples * dp * accumulate
        tokens = sequences * length
    rank_zero_info(
        f"LLMParallelStrategy: global batch {sequences} sequences, {tokens if tokens is not None else 'unknown'} "
        f"tokens per optimizer step (micro-batch × dp={dp} × accumulate_grad_batches={accumulate} × seq_len)"
    )


def _sequence_length(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        batch = batch[0]
    return int(batch.shape[1])
