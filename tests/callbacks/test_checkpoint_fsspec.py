"""CheckpointRotation on fsspec locations (issue 16, item 2): ``memory://`` and ``file://`` URLs for single files
(rotation, markers, verification of corrupted and truncated files, exact resume from "last", asynchronous saves),
sharded DCP checkpoints through torch's fsspec writer (one rank, ``memory://``) and 2-rank ZeRO-3 on a ``file://``
URL (a ``memory://`` filesystem lives in one process), and URLs refused before training."""

from __future__ import annotations

import types
import uuid
from pathlib import Path

import fsspec
import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.callbacks.checkpoint_options import check_remote
from lightning_llm.checkpointing import checksums, files
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.resume_path import check_checkpoint_path
from lightning_llm.testing import run_distributed
from tests.callbacks.test_checkpoint_rotation import EXACT, noisy_model
from tests.strategies._parity import GlobalLoss, data, make_model


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path, monkeypatch):
    """A checkpoint directory URL: a fresh ``memory://`` one, or ``file://`` on tmp_path; cwd is tmp_path, so a
    URL mistaken for a local path would show up there as a directory named ``memory:`` or ``file:``."""
    monkeypatch.chdir(tmp_path)
    if request.param == "memory":
        location = f"memory://ckpt-{uuid.uuid4().hex}/run"
        yield location
        fsspec.filesystem("memory").rm(cfs.filesystem(location)[1].rsplit("/", 1)[0], recursive=True)
    else:
        yield f"file://{tmp_path}/run"
    assert not {p.name for p in tmp_path.iterdir()} & {"memory:", "file:"}, "a URL was written as a local path"


def fit(url, steps, ckpt_path=None, model=None, strategy="auto", **rotation):
    recorder = GlobalLoss()
    callback = CheckpointRotation(dirpath=url, **{"every_n_train_steps": 1, **rotation})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback, recorder],
        default_root_dir=".",
    )
    trainer.fit(model or noisy_model(), data(8), ckpt_path=ckpt_path)
    return recorder.losses, trainer


def steps_in(url) -> list[int]:
    return [files.read_marker(p)["step"] for p in files.complete_checkpoints(url)]


def damage(location: str, how: str) -> None:
    """Invert 64 bytes in the middle of a file (``flip``) or cut off its second half (``truncate``), through fsspec."""
    fs, path = cfs.filesystem(location)
    raw = bytearray(fs.cat_file(path))
    if how == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        middle = len(raw) // 2
        raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    fs.pipe_file(path, bytes(raw))


@pytest.mark.timeout(120)
def test_rotation_markers_and_exact_resume_from_last(url):
    straight, _ = fit(url + "-straight", 6)
    first, _ = fit(url, 3, keep_last=2)
    assert steps_in(url) == [2, 3], "keep_last=2"
    names = cfs.listdir(url)
    assert names == [
        "step=00000002.ckpt",
        "step=00000002.ckpt.meta.json",
        "step=00000003.ckpt",
        "step=00000003.ckpt.meta.json",
    ], names
    meta = files.read_marker(cfs.join(url, "step=00000003.ckpt"))
    assert meta["checksums"]["."]["size"] == cfs.size(cfs.join(url, "step=00000003.ckpt"))
    second, trainer = fit(url, 6, ckpt_path="last", keep_last=1)
    assert trainer.ckpt_path == cfs.join(url, "step=00000003.ckpt"), "'last' is the newest complete checkpoint"
    assert steps_in(url) == [3, 6], "keep_last=1 keeps the newest, and the one resumed from is never deleted"
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), **EXACT)
    if url.startswith("file://"):  # the URL names the local directory itself
        assert sorted(p.name for p in Path(url[len("file://") :]).iterdir()) == [
            "step=00000003.ckpt",
            "step=00000003.ckpt.meta.json",
            "step=00000006.ckpt",
            "step=00000006.ckpt.meta.json",
        ]


@pytest.mark.timeout(120)
def test_corrupted_and_truncated_checkpoints_are_caught_on_the_filesystem(url):
    fit(url, 4, every_n_train_steps=2, keep_last=5)
    newest = cfs.join(url, "step=00000004.ckpt")
    damage(newest, "flip")
    with pytest.raises(RuntimeError, match=r"CRC-32 .* \(content corrupted\)"):
        checksums.verify_committed(newest)
    with pytest.warns(UserWarning, match=r"'last' skips .*step=00000004.ckpt.*content corrupted"):
        _, trainer = fit(url, 5, ckpt_path="last", every_n_train_steps=100, save_on_train_end=False)
    assert trainer.ckpt_path == cfs.join(url, "step=00000002.ckpt") and trainer.global_step == 5
    with pytest.raises(ValueError, match=r"ckpt_path='.*step=00000004.ckpt' cannot be resumed from: .*corrupted"):
        fit(url, 6, ckpt_path=newest, every_n_train_steps=100)

    older = cfs.join(url, "step=00000002.ckpt")
    damage(older, "truncate")
    with pytest.raises(RuntimeError, match=r"step=00000002.ckpt is (not a readable torch archive|truncated)"):
        files.verify(older)
    with pytest.raises(RuntimeError, match=r"every checkpoint in .* fails verification"), pytest.warns(UserWarning):
        fit(url, 6, ckpt_path="last", every_n_train_steps=100)


@pytest.mark.timeout(120)
def test_a_failed_save_keeps_the_last_good_checkpoint_and_crash_leftovers_are_removed(url, monkeypatch):
    verify = files.verify

    def broken_at_step_4(path, **kwargs):
        if "00000004" in cfs.name(path):
            raise RuntimeError("shard missing")
        verify(path, **kwargs)

    monkeypatch.setattr(files, "verify", broken_at_step_4)
    with pytest.raises(
        RuntimeError,
        match=r"could not save checkpoint step=00000004.ckpt in .*: RuntimeError: shard "
        r"missing\. Nothing was committed and the newest complete checkpoint, "
        r".*step=00000002.ckpt, is kept",
    ):
        fit(url, 6, every_n_train_steps=2, keep_last=1)
    monkeypatch.setattr(files, "verify", verify)
    assert steps_in(url) == [2], "the failed save has no marker: it does not count, the older one is kept"
    # That write's data (in place, or under .tmp- on a local disk) is a leftover, like a crash's data without a marker.
    cfs.filesystem(url)[0].pipe_file(cfs.filesystem(cfs.join(url, "step=00000009.ckpt"))[1], b"half a checkpoint")
    assert len(cfs.listdir(url)) == 4
    _, trainer = fit(url, 3, ckpt_path="last", every_n_train_steps=100)
    assert trainer.ckpt_path == cfs.join(url, "step=00000002.ckpt"), "data without a marker does not count"
    assert cfs.listdir(url) == [
        "step=00000002.ckpt",
        "step=00000002.ckpt.meta.json",
        "step=00000003.ckpt",
        "step=00000003.ckpt.meta.json",
    ], "leftovers are removed when fit starts"


@pytest.mark.timeout(120)
def test_async_single_file_saves_commit_on_the_filesystem(url):
    rotation = dict(every_n_train_steps=2, keep_last=2, async_save=True, verify="load")
    straight, _ = fit(url + "-straight", 6)
    first, _ = fit(url, 4, **rotation)
    second, trainer = fit(url, 6, ckpt_path="last", **rotation)
    assert trainer.checkpoint_callback._async and steps_in(url) == [4, 6]
    for checkpoint in files.complete_checkpoints(url):
        checksums.verify_committed(checkpoint)
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(straight), **EXACT)


def test_sharded_checkpoint_on_memory_is_verified_like_a_local_one():
    url = f"memory://sharded-{uuid.uuid4().hex}/step=00000001.ckpt"
    dcp.save({"w": torch.arange(6.0)}, storage_writer=cfs.storage_writer(url))
    cfs.torch_save({"global_step": 1}, cfs.join(url, "meta.pt"))
    files.verify(url, trial_load=True)
    assert files.load_sharded(url)["w"].tolist() == list(range(6)) and not Path("memory:").exists()
    record = checksums.compute(url)
    assert set(record) == {".metadata", "__0_0.distcp", "meta.pt"}
    checksums.check(url, record)
    damage(cfs.join(url, "__0_0.distcp"), "truncate")
    with pytest.raises(RuntimeError, match=r"__0_0.distcp: \d+ bytes, \d+ when saved \(truncated"):
        checksums.check(url, record)
    cfs.remove_tree(cfs.join(url, "__0_0.distcp"))
    with pytest.raises(RuntimeError, match=r"lacks shard files \['__0_0.distcp'\]"):
        files.verify(url)


@pytest.mark.timeout(60)
def test_bad_urls_are_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"'nosuch://bucket/run': fsspec cannot open protocol 'nosuch'"):
        CheckpointRotation(dirpath="nosuch://bucket/run")
    if not _installed("s3fs"):  # not a dependency: without it an s3:// URL is refused, naming the package
        with pytest.raises(ValueError, match=r"'s3://bucket/run': fsspec cannot open protocol 's3'.*s3fs"):
            CheckpointRotation(dirpath="s3://bucket/run")
    with pytest.raises(
        ValueError,
        match=r"dirpath='memory://x/run'\): ModelParallelStrategy writes checkpoints with "
        r"local file APIs.*LLMParallelStrategy",
    ):
        check_remote(ModelParallelStrategy(), "memory://x/run")
    check_remote(ModelParallelStrategy(), f"file://{tmp_path}")  # a file:// URL is a local directory
    two_processes = types.SimpleNamespace(world_size=2)  # what a set-up DDP strategy of 2 ranks reports
    with pytest.raises(
        ValueError,
        match=r"dirpath='memory://x/run'\): a memory:// filesystem lives in one process, "
        r"and this run has 2 processes",
    ):
        check_remote(two_processes, "memory://x/run")
    not_a_checkpoint = f"memory://not-a-checkpoint-{uuid.uuid4().hex}"
    cfs.filesystem(not_a_checkpoint)[0].pipe_file(cfs.filesystem(cfs.join(not_a_checkpoint, "x"))[1], b"")
    with pytest.raises(ValueError, match=rf"ckpt_path='{not_a_checkpoint}' is a directory but not a checkpoint"):
        check_checkpoint_path(not_a_checkpoint, ModelParallelStrategy())


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _sharded_memory(root: str) -> dict:
    """One rank, LLMParallelStrategy (ZeRO-3 on one device), asynchronous DCP saves to memory:// (torch's fsspec
    writer), resumed from "last" (a directory there has no modification time: Lightning is handed its marker)."""
    from lightning_llm.strategies import LLMParallelStrategy

    url = "memory://sharded/run"

    def zero3() -> dict:
        return {"strategy": LLMParallelStrategy(zero_stage=3), "model": make_model("reference")}

    straight, _ = fit(url + "-straight", 6, **zero3())
    first, _ = fit(url, 3, keep_last=2, async_save=True, **zero3())
    newest = files.complete_checkpoints(url)[-1]
    second, trainer = fit(url, 6, ckpt_path="last", keep_last=1, async_save=True, **zero3())
    return {
        "straight": straight,
        "resumed": first + second,
        "steps": steps_in(url),
        "newest": newest,
        "ckpt_path": trainer.ckpt_path,
        "files": sorted(cfs.listdir(newest)),
        "local_leak": Path(root, "memory:").exists(),
    }


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sharded_dcp_checkpoints_through_the_fsspec_writer_resume_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_distributed(_sharded_memory, 1, str(tmp_path), timeout=220)[0]
    assert result["newest"] == "memory://sharded/run/step=00000003.ckpt" and not result["local_leak"]
    assert {".metadata", "__0_0.distcp", "meta.pt"} <= set(result["files"]), result["files"]
    assert result["ckpt_path"] == result["newest"] + ".meta.json", "Lightning is handed the marker, a file"
    assert result["steps"] == [3, 6], "keep_last=1, and the checkpoint resumed from (through its marker) is kept"
    torch.testing.assert_close(torch.tensor(result["resumed"]), torch.tensor(result["straight"]), **EXACT)


def _zero3_file_url(root: str) -> dict:
    from lightning_llm.strategies import LLMParallelStrategy

    url = f"file://{root}/run"

    def run(steps, directory, **kwargs):
        rotation = CheckpointRotation(dirpath=directory, every_n_train_steps=3, keep_last=1, **kwargs.pop("rot", {}))
        recorder = GlobalLoss()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=LLMParallelStrategy(zero_stage=3),
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[rotation, recorder],
            default_root_dir=root,
        )
        trainer.fit(make_model("reference"), data(4), **kwargs)
        return recorder.losses, trainer

    straight, _ = run(6, url + "-straight")
    first, _ = run(3, url, rot={"async_save": True})
    second, trainer = run(6, url, ckpt_path="last")
    try:
        run(3, "memory://two-ranks/run")
        refusal = None
    except ValueError as err:
        refusal = str(err)
    return {
        "straight": straight,
        "resumed": first + second,
        "ckpt_path": trainer.ckpt_path,
        "steps": steps_in(url),
        "files": sorted(cfs.listdir(files.complete_checkpoints(url)[-1])),
        "memory_refusal": refusal,
        "memory_written": cfs.exists("memory://two-ranks/run/step=00000003.ckpt"),
    }


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_rank_zero3_dcp_on_a_file_url_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_distributed(_zero3_file_url, 2, str(tmp_path), timeout=280)[0]
    assert result["ckpt_path"] == f"file://{tmp_path}/run/step=00000003.ckpt"
    assert result["steps"] == [3, 6] and {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= set(
        result["files"]
    )
    assert not (tmp_path / "file:").exists()
    assert "a memory:// filesystem lives in one process, and this run has 2 processes" in result["memory_refusal"]
    assert not result["memory_written"], "refused at setup, before any step"
    torch.testing.assert_close(torch.tensor(result["resumed"]), torch.tensor(result["straight"]), **EXACT)
