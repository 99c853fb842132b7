"""A resume keeps Lightning's rule (the checkpoint's optimizer and scheduler state win over what configure_optimizers
built) and says so once when a configured value lost (issue 53): under this package's strategies, and under
Lightning's own with ResumeChecks (which ``lightning-llm fit`` adds)."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llm.callbacks import ResumeChecks
from lightning_llm.cli import LLMCLI
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer

pytestmark = pytest.mark.timeout(300)


class CosineLM(CausalLM):
    """The reference model with a cosine schedule whose length is a setting the scheduler's state keeps."""

    def __init__(self, t_max: int = 10, **kwargs) -> None:
        super().__init__(**kwargs)
        self.t_max = t_max

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.t_max)]


def _data() -> LLMDataModule:
    return LLMDataModule(num_tokens=4_000, seq_len=32, batch_size=2)


def _resume(tmp_path, saved, resumed, strategy=lambda: "auto", callbacks=()) -> tuple[list[str], object]:
    """Train ``saved`` 2 steps and save; resume ``resumed`` for one step: (the resume warnings, its trainer)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="saved", every_n_train_steps=2)
    cpu_trainer(max_steps=2, strategy=strategy(), callbacks=[checkpoint], enable_checkpointing=True).fit(saved, _data())
    trainer = cpu_trainer(max_steps=3, strategy=strategy(), callbacks=list(callbacks))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(resumed, _data(), ckpt_path=str(tmp_path / "saved.ckpt"))
    assert trainer.global_step == 3  # trained on: Lightning's semantics, not a refusal
    return [str(w.message) for w in caught if str(w.message).startswith("Resumed from")], trainer


def test_a_new_learning_rate_that_the_checkpoint_replaced_is_said_once(tmp_path):
    said, trainer = _resume(
        tmp_path,
        CausalLM(learning_rate=1e-3, max_steps=10),
        CausalLM(learning_rate=2e-3, max_steps=10),
        callbacks=[ResumeChecks()],
    )
    assert len(said) == 1, said
    assert f"Resumed from {tmp_path / 'saved.ckpt'}" in said[0]
    assert "learning rate 0.001 (configured 0.002) in optimizer 0 group 0, optimizer 0 group 1" in said[0]
    assert "on_train_start" in said[0]  # how to use the new value
    assert trainer.optimizers[0].param_groups[0]["initial_lr"] == 1e-3  # the checkpoint's value won, as said


def test_the_same_learning_rate_is_not_mentioned(tmp_path):
    said, _ = _resume(tmp_path, CausalLM(max_steps=10), CausalLM(max_steps=10), callbacks=[ResumeChecks()])
    assert said == []


def test_a_scheduler_setting_the_checkpoint_replaced_is_said(tmp_path):
    said, _ = _resume(tmp_path, CosineLM(t_max=10), CosineLM(t_max=20), callbacks=[ResumeChecks()])
    assert len(said) == 1 and "T_max 10 (configured 20) in scheduler 0 (CosineAnnealingLR)" in said[0], said


@pytest.mark.parametrize("callbacks", [(), (ResumeChecks(),)], ids=["strategy alone", "with ResumeChecks"])
def test_llm_parallel_strategy_says_it_once(tmp_path, callbacks):
    said, _ = _resume(
        tmp_path,
        CausalLM(learning_rate=1e-3, max_steps=10),
        CausalLM(learning_rate=3e-3, max_steps=10),
        strategy=LLMParallelStrategy,
        callbacks=callbacks,
    )
    assert len(said) == 1 and "learning rate 0.001 (configured 0.003)" in said[0], said


def test_lightning_llm_fit_adds_resume_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir=logs"]
    args += ["--trainer.max_steps=1", "--trainer.accelerator=cpu", "--trainer.limit_val_batches=0"]
    cli = LLMCLI(args=[*args, "--data.num_tokens=2000", "--data.seq_len=32"])
    assert sum(isinstance(c, ResumeChecks) for c in cli.trainer.callbacks) == 1
