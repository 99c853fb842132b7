"""A user's own DataModule (a plain shuffled DataLoader) resumes mid-epoch exactly under LLMParallelStrategy.

Oracle: one straight run of the same seed. Lightning injects its ``DistributedSampler`` for ``shuffle=True``; without
the strategy's help a resumed epoch restarts from its first batch (the trained batches again, the last ones never).
Here a run stopped mid-epoch and resumed from its checkpoint must read the same batches and give the same losses,
bitwise, across the epoch boundary after it; on 2 ranks under ZeRO-3 too.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed

STEPS, STOP = 10, 4  # 6 batches an epoch per rank: stopped mid-epoch 0, resumed across the boundary into epoch 1


class Tokens(Dataset):
    def __init__(self, sequences: int) -> None:
        self.data = torch.randint(0, 256, (sequences, 33), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class UserData(L.LightningDataModule):
    def __init__(self, ranks: int) -> None:
        super().__init__()
        self.ranks = ranks

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(12 * self.ranks), batch_size=2, shuffle=True)


class Record(L.Callback):
    def __init__(self) -> None:
        self.batches, self.losses = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch[:, :4].clone())
        self.losses.append(outputs["loss"].item())


def _fit(until: int, root, ranks: int, resume_from=None) -> Record:
    L.seed_everything(0)  # the user's script, run again to resume: the same seed
    record = Record()
    callbacks = [record, ModelCheckpoint(dirpath=root, filename=f"step{until}", every_n_train_steps=until)]
    trainer = cpu_trainer(
        devices=ranks,
        strategy=LLMParallelStrategy(zero_stage=3),
        max_steps=until,
        callbacks=callbacks,
        enable_checkpointing=True,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(CausalLM("tiny", warmup_steps=2, max_steps=STEPS), UserData(ranks), ckpt_path=resume_from)
    record.not_resumable = [w for w in caught if "not resumable" in str(w.message)]
    return record


def _straight_and_resumed(ranks: int, root: str):
    straight = _fit(STEPS, f"{root}/straight", ranks)
    first = _fit(STOP, f"{root}/pieces", ranks)
    second = _fit(STEPS, f"{root}/pieces", ranks, resume_from=f"{root}/pieces/step{STOP}.ckpt")
    return straight, first, second


def _check(straight: Record, first: Record, second: Record) -> None:
    batches = first.batches + second.batches
    assert len(batches) == len(straight.batches) == STEPS
    for step, (got, want) in enumerate(zip(batches, straight.batches)):
        assert torch.equal(got, want), f"step {step} read a different batch after the resume"
    assert first.losses + second.losses == straight.losses  # bitwise
    assert not second.not_resumable, "Lightning's 'not resumable' warning is wrong for this loader"


def _ranked(world_size: int, root: str):
    results = _straight_and_resumed(world_size, root)
    return [(r.batches, r.losses, r.not_resumable) for r in results]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [1, 2], ids=["one-device", "zero3-two-ranks"])
def test_a_user_datamodule_resumes_mid_epoch_exactly(tmp_path, ranks):
    # Each rank checks its own batches and losses; one device runs in a spawned process too (no process group left
    # behind in the test process).
    for rank_result in run_distributed(_ranked, ranks, ranks, str(tmp_path), timeout=280):
        records = []
        for batches, losses, not_resumable in rank_result:
            record = Record()
            record.batches, record.losses, record.not_resumable = batches, losses, not_resumable
            records.append(record)
        _check(*records)
