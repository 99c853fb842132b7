"""A LightningModule written for Lightning's ModelParallelStrategy runs under LLMParallelStrategy unchanged.

Its ``configure_model`` parallelizes by hand on ``self.device_mesh["tensor_parallel"]`` and
``["data_parallel"]`` (Lightning's axis names), with ``tensor_parallel_size="auto"`` (Lightning's meaning: every
device of the node). The strategy then applies nothing of its own. Oracle: the same model trained in one process;
per-step losses and every parameter within 1e-5. Also the model Lightning's own tests use (``w1``/``w2`` read the
residual width, ``w3`` writes it) split by the strategy's inference instead, with no plan given.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, fit_recorded

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
STEPS, BATCH = 4, 8


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class TemplateModel(L.LightningModule):
    """Lightning's ModelParallelStrategy test model, parallelized by hand when ``by_hand``."""

    def __init__(self, by_hand: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.by_hand = by_hand
        self.model = nn.Sequential(FeedForward(), FeedForward())

    def configure_model(self) -> None:
        if not self.by_hand or self.device_mesh is None:
            return
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
        for block in self.model:
            parallelize_module(block, self.device_mesh["tensor_parallel"], plan)
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.model(batch), batch.flip(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(single: bool) -> torch.utils.data.DataLoader:
    inputs = torch.randn(STEPS * BATCH, 16, 32, generator=torch.Generator().manual_seed(1))
    # Lightning gives a distributed run a shuffling DistributedSampler (seed 0); one process reads the same order.
    sampler = DistributedSampler(inputs, num_replicas=1, rank=0, shuffle=True) if single else None
    return torch.utils.data.DataLoader(inputs, batch_size=BATCH, sampler=sampler)


def _fit(module, strategy="auto", devices=1):
    return fit_recorded(module, _data(single=devices == 1), strategy=strategy, devices=devices, max_steps=STEPS)[1]


def _runs():
    import torch.distributed as dist

    from lightning_llm.strategies import LLMParallelStrategy

    by_hand = _fit(TemplateModel(by_hand=True), LLMParallelStrategy(tensor_parallel_size="auto"), devices=2)
    inferred = _fit(TemplateModel(by_hand=False), LLMParallelStrategy(tensor_parallel_size=2), devices=2)
    return (by_hand, inferred) if dist.get_rank() == 0 else None


def test_a_model_parallelized_in_configure_model_and_one_planned_by_inference_match_one_process():
    results = run_distributed(_runs, 2, timeout=240)[0]
    reference = _fit(TemplateModel(by_hand=False))
    for label, result in zip(("configure_model by hand", "inferred plan"), results):
        assert_parity(result, reference, label, rtol=1e-5, loss_rtol=1e-5)
