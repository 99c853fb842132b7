"""A sharded checkpoint, consolidated into one file, resumes under plain Lightning and under the strategy.

Train one epoch under LLMParallelStrategy (ZeRO-3 on 2 ranks, and tp2), save the sharded checkpoint, consolidate
it (``consolidate_checkpoint``), then train a second epoch from that file twice: on one device with Lightning's
default strategy, and under the strategy again. Oracle: one process training both epochs without stopping, on the
same shuffled order; the second epoch's losses and every parameter within 1e-5. The optimizer has two parameter
groups (weight decay on matrices only), so its state must come back in torch's layout, group for group.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_llm.checkpointing.consolidate import consolidate_checkpoint
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, fit_recorded

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
STEPS, BATCH = 3, 4
LAYOUTS = {"zero3": ({"zero_stage": 3}, 2), "tp2": ({"tensor_parallel_size": 2}, 1)}  # kwargs, data-parallel ranks


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(FeedForward(), FeedForward())

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.model(batch), batch.flip(-1))

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])


def _data(dp: int, single: bool) -> torch.utils.data.DataLoader:
    inputs = torch.randn(STEPS * dp * BATCH, 8, 16, generator=torch.Generator().manual_seed(1))
    # One process reads each step's dp batches as one, in the order Lightning's DistributedSampler deals them.
    sampler = DistributedSampler(inputs, num_replicas=1, rank=0, shuffle=True) if single else None
    return torch.utils.data.DataLoader(inputs, batch_size=dp * BATCH if single else BATCH, sampler=sampler)


def _fit(module, dp: int, epochs: int, strategy="auto", devices=1, ckpt_path=None):
    data = _data(dp, single=devices == 1)
    return fit_recorded(module, data, strategy=strategy, devices=devices, ckpt_path=ckpt_path, max_epochs=epochs)


def _runs(tmp_path):
    import torch.distributed as dist

    from lightning_llm.strategies import LLMParallelStrategy

    results = {}
    for label, (kwargs, dp) in LAYOUTS.items():
        trainer, _ = _fit(Model(), dp, 1, LLMParallelStrategy(**kwargs), devices=2)
        trainer.save_checkpoint(tmp_path / f"{label}.ckpt")
        if dist.get_rank() == 0:
            consolidate_checkpoint(tmp_path / f"{label}.ckpt", tmp_path / f"{label}-full.ckpt")
        dist.barrier()
        _, resumed = _fit(
            Model(), dp, 2, LLMParallelStrategy(**kwargs), devices=2, ckpt_path=tmp_path / f"{label}-full.ckpt"
        )
        results[label] = resumed
    return results if dist.get_rank() == 0 else None


def test_a_consolidated_sharded_checkpoint_resumes_on_one_device_and_under_the_strategy(tmp_path):
    under_strategy = run_distributed(_runs, 2, tmp_path, timeout=280)[0]
    for label, (_, dp) in LAYOUTS.items():
        full = torch.load(tmp_path / f"{label}-full.ckpt", weights_only=True)
        assert "optimizer_0" not in full and [
            len(g["params"]) for g in full["optimizer_states"][0]["param_groups"]
        ] == [
            6,
            6,
        ]
        _, (losses, state) = _fit(Model(), dp, 2)  # the oracle: both epochs in one process, without stopping
        want = (losses[STEPS:], state)
        _, on_one_device = _fit(Model(), dp, 2, ckpt_path=tmp_path / f"{label}-full.ckpt")
        assert_parity(on_one_device, want, f"{label} -> one device", rtol=1e-5, loss_rtol=1e-5)
        assert_parity(under_strategy[label], want, f"{label} -> {label} again", rtol=1e-5, loss_rtol=1e-5)
