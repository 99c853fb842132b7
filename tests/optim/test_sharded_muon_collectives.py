"""Under FSDP2, ShardedMuon moves each matrix once each way; torch's Muon communicates inside every iteration.

Oracle: torch's ``CommDebugMode`` counting the functional collectives of one optimizer step on two ranks, each
matrix sharded by ``fully_shard``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from lightning_llm.optim import ShardedMuon
from lightning_llm.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs a newer torch"),
    pytest.mark.distributed,
    pytest.mark.timeout(120),
]


def _collectives_per_step(world_size: int) -> dict[str, dict[str, int]]:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 192, bias=False), torch.nn.Linear(192, 64, bias=False))
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 64)).sum().backward()
    counts = {}
    for name, optimizer in (
        ("torch", torch.optim.Muon(model.parameters())),
        ("sharded", ShardedMuon(model.parameters())),
    ):
        with CommDebugMode() as comm:
            optimizer.step()
        counts[name] = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
    return counts


def test_one_all_gather_and_one_reduce_scatter_per_matrix():
    counts = run_distributed(_collectives_per_step, 2, 2)[0]
    assert counts["sharded"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, counts
    assert sum(counts["torch"].values()) > 4 * sum(counts["sharded"].values()), counts  # 27 on torch 2.13
