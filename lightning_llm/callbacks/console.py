"""Lightning's progress bar and model summary, saying what an LLM run needs: the step budget and the FLOPs.

Two lines of Lightning's console read wrong for a run trained by ``max_steps``: the progress bar's ``Epoch 0/-2``
(Lightning sets ``max_epochs=-1`` when only ``max_steps`` bounds the run, and prints ``max_epochs - 1``) and the
model summary's ``Total FLOPs: 0`` (Lightning counts FLOPs only by running ``example_input_array``, which an LLM
module rarely sets). :class:`StepBudgetProgressBar` prints ``Epoch 0 · max_steps=300`` instead;
:class:`LLMModelSummary` prints the training FLOPs of one optimizer step as this package counts them for
``MFUMonitor`` (:meth:`lightning_llm.modeling.shape.ModelShape.flops_per_token` × the tokens of the global batch),
and shows ``-`` in the per-layer FLOPs column Lightning leaves at zero. ``lightning-llm`` uses both in place of
Lightning's defaults; with your own ``Trainer``, pass them in ``callbacks``.

Example::

    trainer = L.Trainer(max_steps=300, callbacks=[StepBudgetProgressBar(), LLMModelSummary()])
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar
from typing_extensions import override

from lightning_llm.contract import contract_of


class StepBudgetProgressBar(RichProgressBar):
    """Lightning's rich progress bar whose description names the step budget of a run bounded by ``max_steps``
    (``Epoch 0 · max_steps=300``) rather than ``Epoch 0/-2``. Takes ``RichProgressBar``'s arguments."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_steps is not None and trainer.max_steps > 0 and (trainer.max_epochs or -1) < 0:
            description = f"Epoch {current_epoch} · max_steps={trainer.max_steps}"
            if len(self.validation_description) > len(description):  # aligned as Lightning aligns its own
                description = f"{description:{len(self.validation_description)}}"
            return description
        return super()._get_train_description(current_epoch)


class LLMModelSummary(RichModelSummary):
    """Lightning's rich model summary with ``Total FLOPs`` the training FLOPs of one optimizer step (forward and
    backward over the global batch, as ``MFUMonitor`` counts them), where the model's shape and the batch are known.
    Takes ``RichModelSummary``'s arguments (``max_depth=1``: the top-level modules)."""

    flops_per_step: int | None = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.flops_per_step = step_flops(trainer)
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs: Any) -> None:  # fmt: skip
        """Lightning's table, with this package's FLOPs in place of its example-input count (zero here)."""
        if self.flops_per_step is not None:  # per layer: not counted (Lightning's zeros would read as measured)
            summary_data = [(n, ["-"] * len(c) if n == "FLOPs" else c) for n, c in summary_data]
            total_flops = self.flops_per_step
        RichModelSummary.summarize(
            summary_data,
            total_parameters,
            trainable_parameters,
            model_size,
            total_training_modes,
            total_flops=total_flops,
            **summarize_kwargs,
        )


def upgrade_console(callbacks: list) -> None:
    """Lightning's default rich progress bar and model summary in ``callbacks`` become :class:`StepBudgetProgressBar`
    and :class:`LLMModelSummary`, in place (same objects, same settings: the subclasses add no state)."""
    for callback in callbacks:
        if type(callback) is RichProgressBar:
            callback.__class__ = StepBudgetProgressBar
        elif type(callback) is RichModelSummary:
            callback.__class__ = LLMModelSummary


def step_flops(trainer: L.Trainer) -> int | None:
    """Training FLOPs of one optimizer step: FLOPs per token × micro-batch × sequence length × data-parallel size ×
    ``accumulate_grad_batches``; None where the model's shape or the datamodule's ``batch_size``/``seq_len`` is
    unknown."""
    contract = contract_of(trainer)
    shape = contract.model_shape
    hparams = trainer.datamodule.hparams if trainer.datamodule is not None else {}
    batch, seq_len = hparams.get("batch_size"), hparams.get("seq_len")
    if shape is None or not batch or not seq_len:
        return None
    tokens = int(batch) * int(seq_len) * contract.layout.dp * int(trainer.accumulate_grad_batches)
    return int(shape.flops_per_token(int(seq_len)) * tokens)
