"""Sharded (DCP) checkpoints across expert-parallel sizes: saved under one E, resumed under another, exactly.

Mixtral trains 2 steps and saves under one layout, then resumes under another for 2 more steps. The resumed
losses must equal (within 1e-6 relative) those of the same save-and-resume with no expert parallelism at all
(ZeRO 3 to ZeRO 3, which differ from a fresh start's), whatever E saved and whatever E loads: ep2 -> ep2, ep2 -> ep1, ep1 -> ep2 (ZeRO 0). The
expert weights and their optimizer state are ``Shard(0)`` DTensors on the ``ep`` axis, which DCP reshards like any
other layout change.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import GlobalLoss
from tests.zoo._harness import GLOBAL_BATCH, tokens
from tests.zoo._models import ZooLM

pytestmark = [pytest.mark.distributed]
pytest.importorskip("transformers")

ZERO3 = {"zero_stage": 3}
EP2 = {"expert_parallel_size": 2, "zero_stage": 3}
CASES = {
    "zero3->zero3": (ZERO3, ZERO3),  # the baseline: no expert parallelism on either side
    "ep2->ep2": (EP2, EP2),
    "ep2->ep1": (EP2, ZERO3),
    "ep1->ep2_zero0": (ZERO3, {"expert_parallel_size": 2, "zero_stage": 0}),
}


def _fit(kwargs: dict, steps: int, save_dir: Path | None = None, resume: Path | None = None) -> list[float]:
    losses = GlobalLoss()
    callbacks = [losses]
    if save_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=save_dir, filename="s", every_n_train_steps=steps, enable_version_counter=False)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=LLMParallelStrategy(**kwargs),
        max_steps=steps,
        logger=False,
        enable_checkpointing=save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(ZooLM("mixtral"), DataLoader(tokens(), batch_size=GLOBAL_BATCH // 2), ckpt_path=resume)
    return losses.losses


def _save_and_resume(root: str) -> dict:
    resumed = {"fresh": _fit(ZERO3, 2)}  # what a resume that loaded nothing would give
    for label, (saved_under, loaded_under) in CASES.items():
        directory = Path(root) / label.replace(">", "")
        _fit(saved_under, 2, save_dir=directory)
        resumed[label] = _fit(loaded_under, 4, resume=directory / "s.ckpt")
    return resumed


@pytest.mark.timeout(600)
def test_checkpoints_resume_exactly_across_expert_parallel_sizes(tmp_path):
    resumed = run_distributed(_save_and_resume, 2, str(tmp_path), timeout=540)[0]
    baseline, fresh = resumed.pop("zero3->zero3"), resumed.pop("fresh")
    assert all(abs(a - b) > 1e-3 for a, b in zip(baseline, fresh)), (baseline, fresh)  # the resume loaded the state
    for label, losses in resumed.items():
        assert len(losses) == len(baseline) == 2, (label, losses)
        for got, want in zip(losses, baseline):
            assert abs(got - want) / abs(want) <= 1e-6, f"{label}: resumed losses {losses} vs {baseline}"
