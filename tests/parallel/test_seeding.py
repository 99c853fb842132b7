"""One seed for the job, and one ZeRO "auto" decision.

Oracles: ranks seeded differently must end up with the generator state of ``seed_everything(s)`` in one
process, for the seed rank 0 announced; ranks seeded the same must keep their state untouched; a 2-rank
unseeded fit must hold bit-identical parameters on both ranks, equal at the start to the model's own init
in one process after ``torch.manual_seed`` of the agreed seed; the minimum of known per-rank numbers.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

import lightning_llm.strategies.global_batch as global_batch
from lightning_llm.models.llama import Llama
from lightning_llm.testing.distributed import run_distributed
from tests.parallel._init_layouts import CONFIG
from tests.parallel._seeding_ranks import agree, min_memory, unseeded_fit


@pytest.mark.distributed
def test_device_memory_is_the_minimum_over_ranks():
    results = run_distributed(min_memory, 2, timeout=120)
    assert [r["min"] for r in results] == [993, 993]
    assert [r["planned"] for r in results] == [2**30, 2**30]  # rank 0's (r + 1) GiB + r


@pytest.mark.distributed
def test_ranks_seeded_differently_take_rank_zeros_seed():
    first, second = run_distributed(agree, 2, [0, 1], timeout=120)
    assert not torch.equal(first["before"], second["before"])
    assert first["seed"] is not None and first["seed"] == second["seed"]
    L.seed_everything(first["seed"], verbose=False)  # the oracle: one process seeded with the announced seed
    for result in (first, second):
        assert torch.equal(result["torch"], torch.get_rng_state())
        assert np.array_equal(result["numpy"], np.random.get_state()[1])
        assert result["python"] == random.getstate()
    assert len(first["lines"]) == 1 and f"rank 0's seed {first['seed']}" in first["lines"][0]
    assert "seed_everything" in first["lines"][0]
    assert "seed_everything" in first["refused"] and "agree_on_seed" in first["refused"]


@pytest.mark.distributed
def test_ranks_seeded_the_same_are_left_untouched():
    results = run_distributed(agree, 2, [7, 7], timeout=120)
    torch.manual_seed(7)
    for result in results:
        assert result["seed"] is None and result["lines"] == [] and result["refused"] is None
        assert torch.equal(result["torch"], result["before"])
        assert torch.equal(result["torch"], torch.get_rng_state())


@pytest.mark.distributed
def test_unseeded_two_rank_fit_trains_with_identical_replicas():
    first, second = run_distributed(unseeded_fit, 2, timeout=600)
    assert first["seed"] is not None and first["seed"] == second["seed"]
    assert first["global_step"] == second["global_step"] == 2
    # Replicas are bit-identical after training (each rank's own tensors, compared across ranks).
    local0, local1 = first["per_rank"]
    assert local0.keys() == local1.keys()
    for name in local0:
        assert torch.equal(local0[name], local1[name]), name
    # They started from the model's own init in one process, seeded with the agreed seed.
    with torch.device("meta"):
        model = Llama(CONFIG)
    model.to_empty(device="cpu")
    torch.manual_seed(first["seed"])
    with torch.no_grad():
        model.reset_parameters()
    reference = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert first["initial"].keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(first["initial"][name], value), name
    assert any(not torch.equal(first["final"][n], reference[n]) for n in reference)  # it trained
    assert sum(f"rank 0's seed {first['seed']}" in line for line in first["seeding_lines"]) == 1
    # Global batch: batch_size 4 x dp 2 x accumulate 1 = 8 sequences of 16 tokens.
    assert any("global batch 8 sequences, 128 tokens" in line for line in first["setup_lines"])


def _run(batch_size=None, seq_len=None, micro_batch_size=None, planned_seq_len=None, dp=2, accumulate=3, fn="fit"):
    from lightning.pytorch.trainer.states import TrainerFn

    hparams = {k: v for k, v in {"batch_size": batch_size, "seq_len": seq_len}.items() if v is not None}
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(hparams=hparams),
        accumulate_grad_batches=accumulate,
        state=SimpleNamespace(fn=TrainerFn(fn)),
    )
    options = SimpleNamespace(planning=SimpleNamespace(micro_batch_size=micro_batch_size, seq_len=planned_seq_len))
    return trainer, options, SimpleNamespace(parallel_dims=SimpleNamespace(dp=dp))


def test_global_batch_is_micro_batch_times_dp_times_accumulation(monkeypatch):
    lines = []
    monkeypatch.setattr(global_batch, "rank_zero_info", lines.append)
    assert global_batch.global_batch(*_run(batch_size=4, seq_len=32)) == (24, 768)  # 4 x 2 x 3, x 32
    assert global_batch.global_batch(*_run(batch_size=4, micro_batch_size=1, planned_seq_len=8)) == (6, 48)
    assert global_batch.global_batch(*_run(batch_size=4)) == (24, None)
    assert global_batch.global_batch(*_run()) == (None, None)
    global_batch.log_global_batch(*_run(batch_size=4))
    plain_loader = _run()  # neither the options nor a datamodule say the micro-batch: read off the first batch
    global_batch.log_global_batch(*plain_loader)
    assert plain_loader[2].batch_line_pending and len(lines) == 1
    global_batch.log_global_batch(*plain_loader, batch={"input_ids": torch.zeros(5, 16, dtype=torch.long)})
    assert not plain_loader[2].batch_line_pending
    global_batch.log_global_batch(*_run(batch_size=4, seq_len=32, fn="validate"))  # not fitting: nothing
    assert len(lines) == 2
    assert "global batch 24 sequences, unknown tokens" in lines[0]
    assert "global batch 30 sequences, 480 tokens" in lines[1]  # 5 x dp 2 x accumulate 3, x 16
