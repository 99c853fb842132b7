import ctypes
import os
import time
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_llm.testing import DistributedTestError, NativeCrashRetried, cpu_trainer, run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_rank_plus_one():
    dist.init_process_group("gloo")
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    return value.item(), os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def test_all_reduce_on_two_ranks():
    assert run_distributed(_all_reduce_rank_plus_one, 2, timeout=60) == [(3.0, "1", 1), (3.0, "1", 1)]


def _environment_and_directory():
    return os.environ.get("LIGHTNING_LLM_TEST_VALUE"), os.environ.get("RANK"), os.getcwd()


def test_ranks_see_the_callers_environment_and_directory_as_of_the_call(tmp_path, monkeypatch):
    run_distributed(_environment_and_directory, 2)  # the forkserver is running before the variable is set
    monkeypatch.setenv("LIGHTNING_LLM_TEST_VALUE", "set after the first call")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_environment_and_directory, 2) == [
        ("set after the first call", "0", str(tmp_path)),
        ("set after the first call", "1", str(tmp_path)),
    ]
    monkeypatch.delenv("LIGHTNING_LLM_TEST_VALUE")
    assert [value for value, _, _ in run_distributed(_environment_and_directory, 2)] == [None, None]


def _fail_on_rank_one():
    if int(os.environ["RANK"]) == 1:
        raise ValueError("boom on rank one")
    return "fine"


def test_failing_rank_traceback_is_surfaced():
    with pytest.raises(DistributedTestError, match=r"(?s)Rank 1 of 2 failed.*ValueError: boom on rank one"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)


def _root_cause_on_rank_zero():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        time.sleep(0.5)  # rank 1 is inside the collective when rank 0 leaves the group
        raise ValueError("the root cause on rank zero")
    dist.barrier()  # fails when rank 0's connection goes away


def test_the_root_cause_is_shown_first_not_the_peer_that_lost_its_connection():
    with pytest.raises(DistributedTestError) as raised:
        run_distributed(_root_cause_on_rank_zero, 2, timeout=60)
    first, _, rest = str(raised.value).partition("Rank 1 also failed")
    assert first.startswith("Rank 0 of 2 failed") and "ValueError: the root cause on rank zero" in first
    assert rest, "rank 1's own error is summarised after the root cause"


def _segfault_on_rank_one():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash inside a native library would
    dist.barrier()


def test_a_rank_killed_by_a_signal_reports_its_python_stack():
    with pytest.raises(DistributedTestError) as raised:
        run_distributed(_segfault_on_rank_one, 2, timeout=60, native_crash_retries=0)
    crash = str(raised.value).partition("Rank 1 was killed by signal 11; its stack:")[2]
    assert "Segmentation fault" in crash and "in _segfault_on_rank_one" in crash


def _segfault_on_the_first_attempt(marker: str):
    dist.init_process_group("gloo")
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        ctypes.string_at(0)
    dist.barrier()  # rank 0 loses its peer here on the first attempt
    return dist.get_rank()


def test_a_native_crash_runs_the_group_again_once_with_a_warning(tmp_path):
    with pytest.warns(NativeCrashRetried, match="(?s)killed by signal 11.*_segfault_on_the_first_attempt"):
        assert run_distributed(_segfault_on_the_first_attempt, 2, str(tmp_path / "crashed"), timeout=60) == [0, 1]


def test_a_crash_that_comes_back_fails_after_one_retry(tmp_path):
    with pytest.warns(NativeCrashRetried), pytest.raises(DistributedTestError, match="killed by signal 11"):
        run_distributed(_segfault_on_rank_one, 2, timeout=60)


def _error_on_rank_zero_segfault_on_rank_one():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(0.5)
        ctypes.string_at(0)
    raise ValueError("a Python error of its own")


def test_a_python_error_next_to_a_crash_is_not_retried():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NativeCrashRetried)
        with pytest.raises(DistributedTestError, match="a Python error of its own"):
            run_distributed(_error_on_rank_zero_segfault_on_rank_one, 2, timeout=60)


def _hang_in_collective():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(600)


def test_hung_collective_times_out_showing_where_each_rank_waits():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="Timed out") as err:
        run_distributed(_hang_in_collective, 2, timeout=8)
    assert time.monotonic() - start < 40
    rank0, rank1 = str(err.value).split("Rank 0 was still running")[1].split("Rank 1 was still running")
    assert "in barrier" in rank0 and "_hang_in_collective" in rank0, rank0
    assert "in barrier" not in rank1 and "_hang_in_collective" in rank1, rank1


class _Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        # The global-batch loss: every rank logs the mean over both ranks' batches.
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


def _fit(devices: int, batch_size: int):
    torch.manual_seed(0)
    model = _Regression()
    # Lightning's injected sampler would shuffle; a fixed order keeps the reference computation simple.
    sampler = (
        torch.utils.data.DistributedSampler(
            _data(), num_replicas=devices, rank=int(os.environ.get("RANK", 0)), shuffle=False
        )
        if devices > 1
        else None
    )
    loader = DataLoader(_data(), batch_size=batch_size, sampler=sampler)
    trainer = cpu_trainer(
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=5,
    )
    trainer.fit(model, loader)
    return model.losses, model.layer.weight.detach().clone()


def test_two_rank_ddp_fit_matches_single_process():
    # DDP with 2 ranks x 4 samples averages gradients over 8 samples: the same as 1 rank x 8 samples
    # when the distributed sampler hands the ranks interleaved halves of each batch of 8.
    results = run_distributed(_fit, 2, 2, 4, timeout=120)
    (losses0, weight0), (losses1, weight1) = results
    torch.testing.assert_close(weight0, weight1, rtol=0, atol=0)
    torch.manual_seed(0)
    single_model = _Regression()
    optimizer = torch.optim.SGD(single_model.parameters(), lr=0.1)
    data = _data()
    expected = []
    for step in range(5):
        # Rank r reads indices r, r+2, r+4, ...; each step takes 4 of them; an epoch is 4 steps.
        idx = [i for r in range(2) for i in list(range(r, 32, 2))[4 * (step % 4) : 4 * (step % 4) + 4]]
        x, y = data[idx]
        losses = [
            torch.nn.functional.mse_loss(single_model.layer(x[4 * r : 4 * r + 4]), y[4 * r : 4 * r + 4])
            for r in range(2)
        ]
        loss = sum(losses) / 2
        expected.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses0 == pytest.approx(expected, rel=1e-5)
    assert losses1 == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(weight0, single_model.layer.weight.detach(), rtol=1e-5, atol=1e-6)
