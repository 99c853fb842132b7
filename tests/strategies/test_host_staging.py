"""The host copy an asynchronous save writes from: a point-in-time copy, in buffers reused by the next save."""

import torch

from lightning_llm.checkpointing.staging import HostCopy


def _checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "global_step": step,
        "hyper_parameters": {"lr": 0.1, "layers": [1, 2]},
    }


def _train_step(model, optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_copy_is_point_in_time_and_reuses_its_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    copy = HostCopy()

    first_ckpt = _checkpoint(model, optimizer, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    first = copy(first_ckpt)
    _train_step(model, optimizer)  # training changes the live tensors in place
    for key, value in expected.items():
        assert torch.equal(first["state_dict"][key], value), key
        assert not torch.equal(model.state_dict()[key], value), key  # the step really changed it
    moments = first["optimizer_states"][0]["state"][0]["exp_avg"]
    assert moments.data_ptr() != optimizer.state[model[0].weight]["exp_avg"].data_ptr()
    assert first["hyper_parameters"] == first_ckpt["hyper_parameters"] and first["global_step"] == 1

    second = copy(_checkpoint(model, optimizer, 2))
    for key, value in model.state_dict().items():
        assert torch.equal(second["state_dict"][key], value), key
        # the first save's host buffer again (its write has finished by now): nothing allocated, the stall
        # is the copy alone
        assert second["state_dict"][key].data_ptr() == first["state_dict"][key].data_ptr(), key


def test_tied_tensors_stay_shared_and_a_changed_shape_gets_a_new_buffer():
    weight = torch.randn(4, 3)
    copy = HostCopy()
    staged = copy({"embed": weight, "head": weight, "bias": torch.ones(3), "extra": [torch.zeros(2)]})
    assert staged["embed"] is staged["head"]  # one copy, shared as the live tensors are (a file holds it once)
    assert torch.equal(staged["embed"], weight) and staged["embed"].data_ptr() != weight.data_ptr()
    grown = copy({"embed": weight, "head": weight, "bias": torch.ones(5), "extra": [torch.zeros(2)]})
    assert torch.equal(grown["bias"], torch.ones(5))  # not the 3-element buffer of the first save
    assert grown["extra"][0].data_ptr() == staged["extra"][0].data_ptr()  # unchanged shapes keep their buffers


def test_staged_write_writes_the_state_at_save_time_while_training_goes_on(tmp_path):
    """End to end: the file written in the background holds the values of the moment save returned."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_llm.contract.lightning import StagedWrite

    release = threading.Event()

    class SlowWriter(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            release.wait(timeout=30)  # the write starts only after training changed the live tensors
            super().save_checkpoint(checkpoint, path, storage_options)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, optimizer)
    copy = HostCopy()
    with ThreadPoolExecutor(1) as executor:
        for step in (1, 2):  # the second save reuses the first one's host buffers
            release.clear()
            expected = _checkpoint(model, optimizer, step)
            expected = {
                "state_dict": {k: v.clone() for k, v in expected["state_dict"].items()},
                "moments": {k: v["exp_avg"].clone() for k, v in expected["optimizer_states"][0]["state"].items()},
            }
            staged = StagedWrite(SlowWriter(), executor, copy)
            staged.save_checkpoint(_checkpoint(model, optimizer, step), tmp_path / f"{step}.ckpt")
            _train_step(model, optimizer)  # training goes on while the file is not yet written
            release.set()
            staged.future.result()
            written = torch.load(tmp_path / f"{step}.ckpt", weights_only=True)
            for key, value in expected["state_dict"].items():
                assert torch.equal(written["state_dict"][key], value), key
                assert not torch.equal(model.state_dict()[key], value), key  # the live tensor did change
            for index, value in expected["moments"].items():
                assert torch.equal(written["optimizer_states"][0]["state"][index]["exp_avg"], value), index
            assert written["global_step"] == step


def test_gil_slices_are_restored_after_a_write_and_after_a_failed_one(tmp_path):
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import pytest
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_llm.contract.lightning import StagedWrite

    class Failing(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            raise OSError("disk full")

    before = sys.getswitchinterval()
    with ThreadPoolExecutor(1) as executor:
        for inner, path in ((TorchCheckpointIO(), tmp_path / "a.ckpt"), (Failing(), tmp_path / "b.ckpt")):
            staged = StagedWrite(inner, executor)
            staged.save_checkpoint({"w": torch.ones(3)}, path)
            if isinstance(inner, Failing):
                with pytest.raises(OSError, match="disk full"):
                    staged.future.result()
            else:
                staged.future.result()
            assert sys.getswitchinterval() == before
    assert torch.equal(torch.load(tmp_path / "a.ckpt", weights_only=True)["w"], torch.ones(3))


def test_a_gated_write_starts_only_once_released_or_after_the_timeout(tmp_path, monkeypatch):
    """The writer holds off while training has not resumed, never forever."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_llm.checkpointing.write_gate import WriteGate
    from lightning_llm.contract.lightning import StagedWrite

    started = threading.Event()

    class Recording(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            started.set()
            super().save_checkpoint(checkpoint, path, storage_options)

    gate = WriteGate()
    with ThreadPoolExecutor(1) as executor:
        staged = StagedWrite(Recording(), executor, gate=gate)
        staged.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
        assert not started.wait(0.3)  # held: training has not resumed
        gate.release()
        staged.future.result(timeout=10)
        assert started.is_set()

        started.clear()
        monkeypatch.setattr(WriteGate, "TIMEOUT", 0.2)
        begin = time.perf_counter()
        staged = StagedWrite(Recording(), executor, gate=gate)
        staged.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "b.ckpt")  # nobody releases it
        staged.future.result(timeout=10)
        assert 0.15 < time.perf_counter() - begin < 5
    assert torch.equal(torch.load(tmp_path / "b.ckpt", weights_only=True)["w"], torch.zeros(3))


def test_checkpoint_rotation_starts_a_held_write_when_the_next_batch_starts(tmp_path, monkeypatch):
    """Under a trainer the write held at a save starts with the next batch, not at the next save or the timeout."""
    from concurrent.futures import wait

    import lightning as L

    from lightning_llm.callbacks import CheckpointRotation
    from lightning_llm.checkpointing.write_gate import WriteGate
    from lightning_llm.data import LLMDataModule
    from lightning_llm.models import CausalLM

    monkeypatch.setattr(WriteGate, "TIMEOUT", 60.0)  # a missed release would take a minute
    rotation = CheckpointRotation(dirpath=tmp_path, every_n_train_steps=4, keep_last=2, async_save=True)
    written_by_step: dict[int, bool] = {}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 6:  # two batches after the save at step 4, two before the next save
                done, _ = wait([rotation._pending.future], timeout=20)
                written_by_step[6] = bool(done)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rotation, Probe()],
        limit_val_batches=0,
    )
    trainer.fit(CausalLM("tiny"), LLMDataModule(num_tokens=5000, seq_len=16, batch_size=2))
    assert written_by_step == {6: True}
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["step=00000004.ckpt", "step=00000008.ckpt"]


def _dtensor_copies(directory: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    weight = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    state = {"state_dict": {"w": weight, "step": torch.tensor(3.0)}, "meta": [1, "a"]}
    at_save = weight.full_tensor().clone()
    copy = HostCopy()
    staged = copy(state)
    host = staged["state_dict"]["w"]
    with torch.no_grad():
        weight.to_local().add_(1.0)  # training goes on: the live shard changes in place
    checks = {
        "is_dtensor": isinstance(host, DTensor),
        "layout": host.placements == weight.placements and host.shape == weight.shape,
        "point_in_time": torch.equal(host.full_tensor(), at_save),
        "own_storage": host.to_local().data_ptr() != weight.to_local().data_ptr(),
    }
    dcp.save(staged, checkpoint_id=directory)  # what the background writer does with it
    second = copy(state)["state_dict"]["w"]
    checks["reused"] = second.to_local().data_ptr() == host.to_local().data_ptr()
    checks["second_values"] = torch.equal(second.full_tensor(), weight.full_tensor())
    loaded = {"state_dict": {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), "step": torch.tensor(0.0)}}
    dcp.load(loaded, checkpoint_id=directory)
    checks["written"] = torch.equal(loaded["state_dict"]["w"].full_tensor(), at_save)
    checks["scalar"] = float(loaded["state_dict"]["step"]) == 3.0
    dist.barrier()
    return checks


def test_dtensor_shards_are_copied_point_in_time_into_reused_host_dtensors(tmp_path):
    """Sharded (DCP) saves: host DTensors keep the layout, hold the values at save time and DCP writes them."""
    from lightning_llm.testing import run_distributed

    for checks in run_distributed(_dtensor_copies, 2, str(tmp_path / "ckpt"), timeout=120):
        assert all(checks.values()), checks
