"""The progress bar names the step budget and the model summary the FLOPs this package counts (callbacks/console.py).

Lightning's own print ``Epoch 0/-2`` for a run bounded by ``max_steps`` and ``Total FLOPs: 0`` for a module without
``example_input_array``.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar

from lightning_llm.callbacks import LLMModelSummary, StepBudgetProgressBar
from lightning_llm.callbacks.console import upgrade_console
from lightning_llm.data import LLMDataModule
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.models import CausalLM


def _fit(callbacks, **limits) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=callbacks, **limits)
    trainer.fit(CausalLM("tiny"), LLMDataModule(num_tokens=4096, seq_len=32, batch_size=2))
    return trainer


def test_the_progress_bar_names_the_step_budget_and_the_summary_the_step_flops():
    bar, summary = StepBudgetProgressBar(), LLMModelSummary()
    trainer = _fit([bar, summary], max_steps=2, limit_val_batches=0, accumulate_grad_batches=2)
    assert bar._get_train_description(0) == "Epoch 0 · max_steps=2"
    shape = ModelShape.of(trainer.lightning_module)
    assert summary.flops_per_step == shape.flops_per_token(32) * 2 * 32 * 2  # batch × seq_len × accumulate
    assert RichProgressBar._get_train_description(bar, 0) == "Epoch 0/-2"  # what Lightning's own bar says


def test_a_run_bounded_by_epochs_keeps_lightnings_description():
    bar = StepBudgetProgressBar()
    _fit([bar], max_epochs=1, limit_train_batches=1, limit_val_batches=0)
    assert bar._get_train_description(0).rstrip() == "Epoch 0/0"  # padded to the validation description


def test_the_cli_upgrades_lightnings_defaults_only():
    defaults, mine = [RichProgressBar(), RichModelSummary()], StepBudgetProgressBar(refresh_rate=5)
    upgrade_console([*defaults, mine])
    assert [type(c) for c in defaults] == [StepBudgetProgressBar, LLMModelSummary]
    assert mine.refresh_rate == 5
