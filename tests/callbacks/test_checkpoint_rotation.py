"""CheckpointRotation: rotation, metadata, best-k, time trigger, exact resume (1 process, DDP, parallel layouts,
DeepSpeed), async saves, verification, the CLI's --ckpt_path last and what it refuses."""

import os
import types
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import lightning_llm.callbacks.checkpoint as checkpoint_module
from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.checkpointing import files
from lightning_llm.checkpointing.files import complete_checkpoints, marker_path
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import run_distributed
from tests._optional import HAS_DEEPSPEED
from tests.strategies._parity import GlobalLoss, data, make_model

EXACT = dict(rtol=0, atol=1e-7)  # resume must reproduce the uninterrupted fp32 losses


class NoisyLM(CausalLM):
    """Adds a random term to the loss: a resumed run matches the uninterrupted one only if the RNG was restored."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-3 * torch.rand(())


def noisy_model() -> NoisyLM:
    torch.manual_seed(0)
    module = NoisyLM(LlamaConfig.from_name("tiny", n_layers=2), warmup_steps=2, max_steps=20)
    module.configure_model()
    torch.manual_seed(1 + int(os.environ.get("RANK", 0)))  # each rank draws its own noise
    return module


def _fit(callback, steps, root, strategy="auto", devices=1, dp=1, ckpt_path=None, model=None, callbacks=()):
    recorder = GlobalLoss()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, recorder, *callbacks],
        default_root_dir=root,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model or make_model("reference", layers=2), data(8 // dp), ckpt_path=ckpt_path)
    return recorder.losses, trainer


def _steps(directory):
    return [files.read_marker(p)["step"] for p in complete_checkpoints(Path(directory))]


def _straight(root, strategy="auto", devices=1, dp=1):
    """Losses of 20 steps in one run."""
    rotation = CheckpointRotation(dirpath=f"{root}/straight", every_n_train_steps=100)
    return _fit(rotation, 20, root, strategy, devices, dp, model=noisy_model())[0]


def _resumed(root, strategy="auto", devices=1, dp=1, async_save=False):
    """Losses of 10 steps plus 10 more resumed from "last", the checkpoint resumed from and the steps kept."""
    runs = []
    for steps in (10, 20):
        rotation = CheckpointRotation(
            dirpath=f"{root}/resumed", every_n_train_steps=10, keep_last=1, async_save=async_save
        )
        losses, trainer = _fit(rotation, steps, root, strategy, devices, dp, ckpt_path="last", model=noisy_model())
        runs.append((losses, trainer.ckpt_path))
    (first, _), (second, resumed_from) = runs
    return first + second, str(resumed_from), _steps(f"{root}/resumed")


def test_exact_resume_single_process_and_resumed_checkpoint_kept(tmp_path):
    straight = _straight(tmp_path)
    resumed, resumed_from, kept = _resumed(tmp_path)
    assert Path(resumed_from).name == "step=00000010.ckpt", "ckpt_path='last' resolves to the newest complete one"
    assert kept == [10, 20], "keep_last=1, but the checkpoint the run resumed from is never deleted"
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), **EXACT)


def test_the_strategys_checkpoint_io_is_its_own_again_after_fit(tmp_path):
    # A resume from a single-file checkpoint is verified through a stand-in CheckpointIO, for that fit only.
    rotation = CheckpointRotation(dirpath=tmp_path, every_n_train_steps=2)
    trainer = L.Trainer(max_steps=2, callbacks=[rotation], logger=False, enable_progress_bar=False)
    original = trainer.strategy.checkpoint_io
    trainer.fit(noisy_model(), data(2))
    assert trainer.strategy.checkpoint_io is original


def _ddp_resume(root):
    results = {"straight": _straight(root, "ddp", 2, 2)}
    for mode in ("sync", "async"):
        results[mode] = _resumed(f"{root}/{mode}", "ddp", 2, 2, async_save=mode == "async")
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_exact_resume_ddp_two_ranks_sync_and_async(tmp_path):
    results = run_distributed(_ddp_resume, 2, str(tmp_path), timeout=280)[0]
    straight = results.pop("straight")
    for mode, (resumed, resumed_from, kept) in results.items():
        assert Path(resumed_from).name == "step=00000010.ckpt" and kept == [10, 20], mode
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), **EXACT, msg=lambda m: f"{mode}: {m}")


def test_keeps_the_last_k_with_metadata_and_resolves_last(tmp_path):
    callback = CheckpointRotation(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, keep_last=2)
    _fit(callback, 9, tmp_path)
    assert _steps(tmp_path / "ckpt") == [8, 9], "every 2 steps, the end of training, and only the last 2 kept"
    periodic, meta = (files.read_marker(p) for p in complete_checkpoints(tmp_path / "ckpt"))
    assert periodic["epoch"] == 0 and meta["epoch"] == 1, "at the end, Lightning counts the epoch as done"
    assert meta["step"] == 9 and meta["tokens_seen"] == 9 * 8 * 32
    assert meta["layout"] == {
        "strategy": "SingleDeviceStrategy",
        "world_size": 1,
        "num_nodes": 1,
        "tp": 1,
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 1,
        "zero_stage": None,
        "dp": 1,
    }
    assert meta["config"]["warmup_steps"] == 2 and isinstance(meta["loss"], float) and meta["wall_time"] > 0
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")], "no leftovers"
    assert callback._find_last_checkpoints(None) == {str(complete_checkpoints(tmp_path / "ckpt")[-1])}


def test_best_k_is_kept_beside_the_last(tmp_path):
    callback = CheckpointRotation(
        dirpath=str(tmp_path), every_n_train_steps=1, keep_last=1, monitor="train_loss", mode="max", keep_best=1
    )
    losses, _ = _fit(callback, 6, tmp_path)
    # the loss falls as it trains: the highest loss among the saved steps is the first one
    assert losses[0] == max(losses) and _steps(tmp_path) == [1, 6]
    assert Path(callback.best_model_path).name == "step=00000001.ckpt"
    assert callback.best_model_score.item() == pytest.approx(losses[0])


def test_saves_every_n_minutes_by_rank_zero_clock(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(checkpoint_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=lambda: 1.0))

    class Tick(L.Callback):
        def on_train_batch_start(self, *args):
            clock[0] += 60.0  # each step takes a minute

    rotation = CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=None, every_n_minutes=2.5, keep_last=9)
    _fit(rotation, 7, tmp_path, callbacks=[Tick()])
    assert _steps(tmp_path) == [3, 6, 7], "3 minutes passed at steps 3 and 6; 7 is the end of training"


def test_resuming_an_older_checkpoint_starts_a_new_timeline(tmp_path):
    _fit(CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=5), 6, tmp_path)
    older = tmp_path / "step=00000002.ckpt"
    rotation = CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=3, keep_last=1)
    _fit(rotation, 5, tmp_path, ckpt_path=str(older))
    # steps 4 and 6 belong to the abandoned timeline: the newest save is step 5, though 6 > 5
    assert _steps(tmp_path) == [2, 5], "kept: the checkpoint resumed from and the newest save"
    assert rotation._find_last_checkpoints(None) == {str(tmp_path / "step=00000005.ckpt")}


def test_incomplete_leftovers_are_removed_and_ignored(tmp_path):
    _fit(CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=5), 2, tmp_path)
    (tmp_path / ".tmp-step=00000004.ckpt").mkdir()
    (tmp_path / "step=00000006.ckpt").write_bytes(b"half a checkpoint")  # no marker: a crash mid-save
    (tmp_path / ".deleting-step=00000000.ckpt").write_bytes(b"x")
    assert _steps(tmp_path) == [2]
    _, trainer = _fit(CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=100), 3, tmp_path, ckpt_path="last")
    assert Path(trainer.ckpt_path).name == "step=00000002.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step=00000002.ckpt",
        "step=00000002.ckpt.meta.json",
        "step=00000003.ckpt",
        "step=00000003.ckpt.meta.json",
    ]


def test_async_single_file_checkpoints_complete_and_load(tmp_path):
    callback = CheckpointRotation(
        dirpath=str(tmp_path), every_n_train_steps=2, keep_last=2, async_save=True, verify="load"
    )
    _fit(callback, 6, tmp_path)
    assert callback._async and _steps(tmp_path) == [4, 6]
    state = torch.load(complete_checkpoints(tmp_path)[-1], weights_only=True)
    assert state["global_step"] == 6 and len(state[checkpoint_module.RNG_KEY]) == 1


def test_failed_verification_keeps_older_checkpoints_and_stops(tmp_path, monkeypatch):
    verify = files.verify

    def broken_at_step_4(path, **kwargs):
        if "00000004" in Path(path).name:
            raise RuntimeError("shard missing")
        verify(path, **kwargs)

    monkeypatch.setattr(files, "verify", broken_at_step_4)
    with pytest.raises(
        RuntimeError,
        match=r"could not save checkpoint step=00000004.ckpt in .*: RuntimeError: shard missing\. "
        r"Nothing was committed and the newest complete checkpoint, .*step=00000002.ckpt, is kept",
    ):
        _fit(CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=1), 6, tmp_path)
    assert _steps(tmp_path) == [2], "the older checkpoint survives a new one that failed verification"


def test_verify_finds_corrupt_and_missing_parts(tmp_path):
    archive = tmp_path / "a.ckpt"
    torch.save({"w": torch.ones(1000)}, archive)
    files.verify(archive, trial_load=True)
    archive.write_bytes(archive.read_bytes()[:-100])
    with pytest.raises(RuntimeError, match="a.ckpt is not a readable torch archive"):
        files.verify(archive)

    sharded = tmp_path / "sharded.ckpt"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=sharded)
    torch.save({"global_step": 1}, sharded / "meta.pt")
    files.verify(sharded, trial_load=True)
    for shard in sharded.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(RuntimeError, match="lacks shard files"):
        files.verify(sharded)

    deepspeed = tmp_path / "ds.ckpt"
    (deepspeed / "checkpoint").mkdir(parents=True)
    (deepspeed / "latest").write_text("checkpoint")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({}, deepspeed / "checkpoint" / name)
    files.verify(deepspeed, world_size=1)
    with pytest.raises(RuntimeError, match=r"lacks optim states of ranks \[1\]"):
        files.verify(deepspeed, world_size=2)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0: at least 1"):
        CheckpointRotation(keep_last=0)
    with pytest.raises(ValueError, match="every_n_train_steps=0 must be a positive number"):
        CheckpointRotation(every_n_train_steps=0)
    with pytest.raises(ValueError, match="every_n_minutes=0 must be a positive"):
        CheckpointRotation(every_n_minutes=0)
    with pytest.raises(ValueError, match="would never save"):
        CheckpointRotation(every_n_train_steps=None, save_on_train_end=False)
    with pytest.raises(ValueError, match="keep_best=1 needs `monitor`"):
        CheckpointRotation(keep_best=1)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="cannot write to .*a_file/ckpt"):
        _fit(CheckpointRotation(dirpath=str(tmp_path / "a_file" / "ckpt")), 1, tmp_path)
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[AsyncCheckpointIO()],
        logger=False,
        max_steps=1,
        callbacks=[CheckpointRotation(dirpath=str(tmp_path))],
    )
    with pytest.raises(ValueError, match="Remove the AsyncCheckpointIO plugin"):
        trainer.fit(make_model("reference"), data(8))
    assert trainer.global_step == 0, "refused at setup, before any step"


def test_cli_ckpt_path_last_resumes_from_the_default_directory(tmp_path, monkeypatch):
    """`lightning-llm fit --ckpt_path last`, no dirpath, a logger whose version changes between the runs."""
    from lightning_llm.cli import main

    monkeypatch.chdir(tmp_path)
    config = {
        "seed_everything": 1,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 4,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "logs"}},
            "callbacks": [
                {
                    "class_path": "lightning_llm.callbacks.CheckpointRotation",
                    "init_args": {"every_n_train_steps": 2, "keep_last": 5},
                }
            ],
        },
        "model": {"class_path": "lightning_llm.models.CausalLM", "init_args": {"config": "tiny", "warmup_steps": 1}},
        "data": {
            "class_path": "lightning_llm.data.LLMDataModule",
            "init_args": {"num_tokens": 5000, "seq_len": 16, "batch_size": 2},
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    main(["fit", "--config", "config.yaml"])
    first = {Path(p).name: Path(marker_path(p)).read_text() for p in complete_checkpoints(tmp_path / "checkpoints")}
    main(["fit", "--config", "config.yaml", "--trainer.max_steps", "8", "--ckpt_path", "last"])
    assert sorted(p.name for p in (tmp_path / "logs" / "lightning_logs").iterdir()) == ["version_0", "version_1"], (
        sorted(map(str, tmp_path.rglob("*")))
    )
    final = complete_checkpoints(tmp_path / "checkpoints")
    assert _steps(tmp_path / "checkpoints") == [2, 4, 6, 8]
    assert {name: Path(marker_path(tmp_path / "checkpoints" / name)).read_text() for name in first} == first, (
        "the resumed run started at step 4: it did not save steps 2 and 4 again"
    )
    assert files.read_marker(final[-1])["tokens_seen"] == 8 * 2 * 16, "tokens seen carry over"


def _resume_layouts(root):
    from lightning_llm.strategies import LLMDeepSpeedStrategy, LLMParallelStrategy

    layouts = {
        "dp2-zero3-async": (lambda: LLMParallelStrategy(zero_stage=3), 2, True),
        "tp2": (lambda: LLMParallelStrategy(tensor_parallel_size=2), 1, False),
        "pp2": (lambda: LLMParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), 1, False),
    }
    if HAS_DEEPSPEED:  # an optional extra
        layouts["deepspeed-zero2"] = (lambda: LLMDeepSpeedStrategy(zero_stage=2), 2, False)
    results = {}
    for label, (strategy, dp, asynchronous) in layouts.items():
        directory = f"{root}/{label}"
        losses = []
        for steps in (5, 10):
            rotation = CheckpointRotation(
                dirpath=directory, every_n_train_steps=5, async_save=asynchronous, verify="load"
            )
            losses += _fit(rotation, steps, root, strategy(), 2, dp, ckpt_path="last")[0]
        last = complete_checkpoints(directory)[-1]
        layout = {
            **files.read_marker(last)["layout"],
            "async": rotation._async,
            "files": sorted(os.listdir(last)),
            "deepspeed_files": sorted(os.listdir(Path(last) / "checkpoint")) if label.startswith("deepspeed") else [],
        }
        results[label] = (losses, _steps(directory), layout)
    return results


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_exact_resume_under_parallel_layouts(tmp_path):
    straight, _ = _fit(CheckpointRotation(dirpath=str(tmp_path / "single"), every_n_train_steps=100), 10, tmp_path)
    results = run_distributed(_resume_layouts, 2, str(tmp_path), timeout=560)[0]
    assert results["tp2"][2]["tp"] == 2 and results["pp2"][2]["pp"] == 2
    assert results["dp2-zero3-async"][2]["zero_stage"] == 3 and results["dp2-zero3-async"][2]["async"]
    assert ".metadata" in results["tp2"][2]["files"], "a torch.distributed.checkpoint directory"
    if HAS_DEEPSPEED:
        deepspeed = results["deepspeed-zero2"][2]
        assert deepspeed["zero_stage"] == 2 and {"checkpoint", "latest"} <= set(deepspeed["files"]), deepspeed
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in deepspeed["deepspeed_files"], "verified per rank"
    for label, (losses, steps, _) in results.items():
        assert steps == [5, 10], label
        # fp32: the parallel layouts differ from one process only by summation order.
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(straight), rtol=1e-5, atol=0, msg=lambda m: f"{label}: {m}"
        )


def test_last_with_no_checkpoint_starts_fresh_without_lightnings_save_last_hint(tmp_path, caplog, recwarn):
    with caplog.at_level("INFO"):
        losses, _ = _fit(
            CheckpointRotation(dirpath=tmp_path / "ckpt", every_n_train_steps=2), 2, tmp_path, ckpt_path="last"
        )
    assert len(losses) == 2
    assert "no complete checkpoint in" in caplog.text and "starts fresh" in caplog.text
    assert not [w for w in recwarn if "save_last" in str(w.message)]  # the hint is for ModelCheckpoint, not this one
