"""CheckpointRotation: rotation, metadata, best-k, resume, async saves and what it refuses."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.callbacks.checkpoint_files import complete_checkpoints, marker_path
from lightning_llm.testing import run_distributed
from tests.strategies._parity import GlobalLoss, data, make_model


def _fit(callback, steps, root, strategy="auto", devices=1, dp=1, ckpt_path=None, arch="reference"):
    recorder = GlobalLoss()
    model = make_model(arch, layers=4)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, recorder],
                        default_root_dir=root, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, data(8 // dp), ckpt_path=ckpt_path)
    return recorder.losses, trainer


def _steps(directory):
    return [json.loads(marker_path(p).read_text())["step"] for p in complete_checkpoints(Path(directory))]


def test_keeps_the_last_k_with_metadata_and_resolves_last(tmp_path):
    callback = CheckpointRotation(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, keep_last=2)
    _fit(callback, 9, tmp_path)
    assert _steps(tmp_path / "ckpt") == [8, 9], "every 2 steps, the end of training, and only the last 2 kept"
    meta = json.loads(marker_path(complete_checkpoints(tmp_path / "ckpt")[-1]).read_text())
    assert meta["step"] == 9 and meta["tokens_seen"] == 9 * 8 * 32 and meta["layout"]["world_size"] == 1
    assert meta["config"]["warmup_steps"] == 2 and isinstance(meta["loss"], float) and meta["wall_time"] > 0
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")], "no leftovers"
    assert callback._find_last_checkpoints(None) == {str(complete_checkpoints(tmp_path / "ckpt")[-1])}


def test_best_k_is_kept_beside_the_last(tmp_path):
    callback = CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=1, keep_last=1, monitor="train_loss",
                                  mode="max", keep_best=1)
    _fit(callback, 6, tmp_path)
    kept = _steps(tmp_path)
    assert len(kept) == 2 and kept[-1] == 6
    # the loss falls as it trains: the highest loss among the saved steps is the first one
    assert kept[0] == 1


def test_resumed_checkpoint_is_never_deleted_and_resume_is_exact(tmp_path):
    straight, _ = _fit(CheckpointRotation(dirpath=str(tmp_path / "a"), every_n_train_steps=5), 10, tmp_path)
    first, _ = _fit(CheckpointRotation(dirpath=str(tmp_path / "b"), every_n_train_steps=5, keep_last=1), 5, tmp_path)
    resumed_from = complete_checkpoints(tmp_path / "b")[-1]
    second, _ = _fit(CheckpointRotation(dirpath=str(tmp_path / "b"), every_n_train_steps=1, keep_last=1), 10, tmp_path,
                     ckpt_path="last")
    assert resumed_from in complete_checkpoints(tmp_path / "b")
    assert _steps(tmp_path / "b") == [5, 10]
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), rtol=1e-7, atol=0)


def test_incomplete_leftovers_are_removed_and_ignored(tmp_path):
    _fit(CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=5), 2, tmp_path)
    (tmp_path / ".tmp-step=00000004.ckpt").mkdir()
    (tmp_path / "step=00000006.ckpt").write_bytes(b"half a checkpoint")  # no marker: a crash mid-save
    (tmp_path / ".deleting-step=00000000.ckpt").write_bytes(b"x")
    assert _steps(tmp_path) == [2]
    _fit(CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=100), 3, tmp_path, ckpt_path="last")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step=00000002.ckpt", "step=00000002.ckpt.meta.json", "step=00000003.ckpt", "step=00000003.ckpt.meta.json"]


def test_async_single_file_checkpoints_complete_and_load(tmp_path):
    callback = CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=2, async_save=True, verify="load")
    _fit(callback, 6, tmp_path)
    assert _steps(tmp_path) == [4, 6]
    state = torch.load(complete_checkpoints(tmp_path)[-1], weights_only=False)
    assert state["global_step"] == 6


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0: at least 1"):
        CheckpointRotation(keep_last=0)
    with pytest.raises(ValueError, match="every_n_train_steps=0 must be a positive number"):
        CheckpointRotation(every_n_train_steps=0)
    with pytest.raises(ValueError, match="every_n_minutes=0 must be a positive"):
        CheckpointRotation(every_n_minutes=0)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="cannot write to .*a_file/ckpt"):
        _fit(CheckpointRotation(dirpath=str(tmp_path / "a_file" / "ckpt")), 1, tmp_path)


def _resume_layouts(world_size, root):
    from lightning_llm.strategies import LLMParallelStrategy

    layouts = {
        "dp2-zero3": ({"zero_stage": 3}, 2),
        "dp2-zero3-async": ({"zero_stage": 3}, 2),
        "tp2": ({"tensor_parallel_size": 2}, 1),
        "pp2": ({"pipeline_parallel_size": 2, "num_microbatches": 2}, 1),
    }
    results = {}
    for label, (layout, dp) in layouts.items():
        directory = f"{root}/{label}"
        asynchronous = label.endswith("async")
        first, _ = _fit(CheckpointRotation(dirpath=directory, every_n_train_steps=5, async_save=asynchronous), 5, root,
                        LLMParallelStrategy(**layout), world_size, dp)
        second, _ = _fit(CheckpointRotation(dirpath=directory, every_n_train_steps=5, async_save=asynchronous), 10, root,
                         LLMParallelStrategy(**layout), world_size, dp, ckpt_path="last")
        results[label] = (first + second, _steps(directory))
    return results


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_exact_resume_under_parallel_layouts(tmp_path):
    straight, _ = _fit(CheckpointRotation(dirpath=str(tmp_path / "single"), every_n_train_steps=100), 10, tmp_path)
    results = run_distributed(_resume_layouts, 2, 2, str(tmp_path), timeout=540)[0]
    for label, (losses, steps) in results.items():
        assert steps == [5, 10], label
        # fp32: the parallel layouts differ from one process only by summation order.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(straight), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{label}: {m}")
