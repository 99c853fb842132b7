"""Checkpoints under LLMParallelStrategy (ZeRO-3), DDP and DeepSpeed on 2 ranks are never silently wrong (issue 14):
strict loading both ways, a corrupted shard skipped by ckpt_path="last", a full disk (an injected ENOSPC) on one rank
raised alike on both (sync and async), and exact resume from save_distributed_checkpoint=False checkpoints.

One 2-rank job (the module fixture) runs every case; the tests read its results.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.checkpointing import files
from lightning_llm.testing import run_distributed
from tests._optional import HAS_DEEPSPEED, requires_deepspeed
from tests.callbacks.test_checkpoint_safety import FullDisk
from tests.strategies._parity import GlobalLoss, data, full_state, make_model

EXACT = dict(rtol=0, atol=1e-7)


def _fit(root, steps, strategy, model=None, callbacks=(), ckpt_path=None, plugins=()):
    recorder = GlobalLoss()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, *callbacks],
        default_root_dir=root,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        plugins=list(plugins),
    )
    model = model or make_model("reference")
    trainer.fit(model, data(4), ckpt_path=ckpt_path)
    return trainer, model, recorder.losses


def _error(run) -> str | None:
    try:
        run()
    except Exception as err:
        return str(err)
    return None


def _zero3(**kwargs):
    from lightning_llm.strategies import LLMParallelStrategy

    return LLMParallelStrategy(zero_stage=3, **kwargs)


def _flip_a_tensor_in_a_shard(checkpoint: Path) -> str:
    """Invert 64 bytes in the middle of the largest model tensor's bytes inside its shard file."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    info = max(
        (s for i, s in metadata.storage_data.items() if i.fqn.startswith("state_dict.")), key=lambda item: item.length
    )
    shard = checkpoint / info.relative_path
    raw = bytearray(shard.read_bytes())
    middle = info.offset + info.length // 2
    raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    shard.write_bytes(bytes(raw))
    return info.relative_path


def _strict_loading(root: str) -> dict:
    """A 2-layer ZeRO-3 checkpoint into a 1-layer model: refused; with strict_loading=False, loaded."""
    two = f"{root}/two"
    _fit(root, 4, _zero3(), callbacks=[CheckpointRotation(dirpath=two, every_n_train_steps=2, keep_last=5)])
    saved = f"{two}/step=00000004.ckpt"
    refused = _error(lambda: _fit(root, 4, _zero3(), model=make_model("reference", layers=1), ckpt_path=saved))
    lenient = make_model("reference", layers=1)
    lenient.strict_loading = False
    _, model, _ = _fit(root, 4, _zero3(), model=lenient, ckpt_path=saved)  # restored at step 4: no step runs
    return {"refused": refused, "lenient_state": full_state(model), "saved": saved}


def _deepspeed_strict(root: str) -> dict:
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    shard_all = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    saved = f"{root}/ds/step=00000002.ckpt"
    _fit(
        root,
        2,
        LLMDeepSpeedStrategy(zero_stage=3, config=shard_all),
        callbacks=[CheckpointRotation(dirpath=f"{root}/ds", every_n_train_steps=2)],
    )
    refused = _error(
        lambda: _fit(
            root,
            2,
            LLMDeepSpeedStrategy(zero_stage=3, config=shard_all),
            model=make_model("reference", layers=1),
            ckpt_path=saved,
        )
    )
    return {"refused": refused}


def _corrupt_shard_fallback(root: str) -> dict:
    newest = Path(f"{root}/two/step=00000004.ckpt")
    if torch.distributed.get_rank() == 0:
        _flip_a_tensor_in_a_shard(newest)
    torch.distributed.barrier()
    explicit = _error(lambda: _fit(root, 4, _zero3(), ckpt_path=str(newest)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _, _ = _fit(
            root,
            4,
            _zero3(),
            ckpt_path="last",
            callbacks=[CheckpointRotation(dirpath=f"{root}/two", every_n_train_steps=100)],
        )
    return {
        "resumed_from": Path(trainer.ckpt_path).name,
        "explicit": explicit,
        "warnings": [str(w.message) for w in caught if "skips" in str(w.message)],
    }


def _disk_full(root: str) -> dict:
    """ENOSPC on rank 1 only (DCP shards, sync and async) and on rank 0 only (DDP's single file, sync and async)."""
    original = _FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if "step=00000004" in str(self.path) and torch.distributed.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return original(self, plan, planner)

    cases = [
        ("zero3-sync", _zero3, False, ()),
        ("zero3-async", _zero3, True, ()),
        ("ddp-sync", lambda: "ddp", False, (FullDisk(),)),
        ("ddp-async", lambda: "ddp", True, (FullDisk(),)),
    ]
    restore = [(_FileSystemWriter, "write_data", original)]
    _FileSystemWriter.write_data = write_data
    if HAS_DEEPSPEED:  # the DeepSpeed case only where DeepSpeed is installed (an optional extra)
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        from lightning_llm.strategies import LLMDeepSpeedStrategy

        original_ds = TorchCheckpointEngine.save

        def deepspeed_save(self, state_dict, path):
            if "step=00000004" in str(path) and torch.distributed.get_rank() == 1:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return original_ds(self, state_dict, path)

        TorchCheckpointEngine.save = deepspeed_save
        restore.append((TorchCheckpointEngine, "save", original_ds))
        cases.append(("deepspeed", lambda: LLMDeepSpeedStrategy(zero_stage=2), False, ()))
    results = {}
    try:
        for label, strategy, asynchronous, plugins in cases:
            directory = f"{root}/full/{label}"
            rotation = CheckpointRotation(
                dirpath=directory, every_n_train_steps=2, keep_last=1, async_save=asynchronous
            )
            chosen = strategy()
            error = _error(lambda s=chosen, r=rotation, p=plugins: _fit(root, 6, s, callbacks=[r], plugins=p))
            results[label] = {
                "error": error,
                "steps": [files.read_marker(p)["step"] for p in files.complete_checkpoints(Path(directory))],
            }
    finally:
        for owner, name, value in restore:
            setattr(owner, name, value)
    # The checkpoint kept after the failed async DCP save resumes.
    trainer, _, _ = _fit(
        root,
        3,
        _zero3(),
        ckpt_path="last",
        callbacks=[CheckpointRotation(dirpath=f"{root}/full/zero3-async", every_n_train_steps=100)],
    )
    results["resumed"] = (Path(trainer.ckpt_path).name, trainer.global_step)
    return results


def _full_state_resume(root: str) -> dict:
    """save_distributed_checkpoint=False: 3 steps, then 3 more resumed from the file, against 6 straight steps."""
    _, _, straight = _fit(root, 6, _zero3(save_distributed_checkpoint=False))
    resumed = []
    for steps in (3, 6):
        rotation = CheckpointRotation(dirpath=f"{root}/full_state", every_n_train_steps=3)
        trainer, _, losses = _fit(
            root, steps, _zero3(save_distributed_checkpoint=False), callbacks=[rotation], ckpt_path="last"
        )
        resumed += losses
    return {
        "straight": straight,
        "resumed": resumed,
        "resumed_from": Path(trainer.ckpt_path).name,
        "is_file": Path(trainer.ckpt_path).is_file(),
    }


def _all_cases(root: str) -> dict:
    return {
        "strict": _strict_loading(root),
        "deepspeed": _deepspeed_strict(root) if HAS_DEEPSPEED else None,
        "corrupt": _corrupt_shard_fallback(root),
        "disk_full": _disk_full(root),
        "full_state": _full_state_resume(root),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint_loading")
    return run_distributed(_all_cases, 2, str(root), timeout=400)


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_a_two_layer_checkpoint_into_a_one_layer_model_is_refused_unless_strict_loading_is_off(results):
    for rank in results:
        refused = rank["strict"]["refused"]
        assert (
            refused and "does not fit the model: in the checkpoint but not in the model: 9 (model.layers.1." in refused
        ), refused
        assert "strict_loading = False" in refused
    # Oracle: the checkpoint read back by torch.distributed.checkpoint without any process group.
    saved = _load_distributed_checkpoint(Path(results[0]["strict"]["saved"]))["state_dict"]
    lenient = results[0]["strict"]["lenient_state"]
    assert lenient.keys() < saved.keys() and "model.layers.0.attention.q_proj.weight" in lenient
    for name, tensor in lenient.items():
        torch.testing.assert_close(tensor, saved[name].float(), rtol=0, atol=0, msg=name)


@requires_deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_deepspeed_zero3_refuses_a_checkpoint_of_another_model(results):
    for rank in results:
        refused = rank["deepspeed"]["refused"]
        assert refused and "in the checkpoint but not in the model" in refused and "layers.1." in refused, refused


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_corrupted_shard_falls_back_to_the_older_checkpoint(results):
    corrupt = results[0]["corrupt"]
    assert (
        corrupt["resumed_from"] == "step=00000002.ckpt"
        and results[1]["corrupt"]["resumed_from"] == "step=00000002.ckpt"
    )
    assert any("step=00000004.ckpt" in w and "content corrupted" in w for w in corrupt["warnings"]), corrupt
    for rank in results:  # the same checkpoint named explicitly is refused, on every rank
        assert "step=00000004.ckpt' cannot be resumed from" in rank["corrupt"]["explicit"], rank["corrupt"]["explicit"]
        assert (
            "(content corrupted)" in rank["corrupt"]["explicit"] and "ckpt_path='last'" in rank["corrupt"]["explicit"]
        )


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_disk_full_on_one_rank_is_the_same_clear_error_on_both_and_keeps_the_older_checkpoint(results):
    for label in ("zero3-sync", "zero3-async", "ddp-sync", "ddp-async") + (("deepspeed",) if HAS_DEEPSPEED else ()):
        errors = [rank["disk_full"][label]["error"] for rank in results]
        assert errors[0] == errors[1] and errors[0] is not None, (label, errors)
        failing_rank = 0 if label.startswith("ddp") else 1
        assert "could not save checkpoint step=00000004.ckpt in " in errors[0], errors[0]
        assert f"rank {failing_rank}: no space left on the device (ENOSPC" in errors[0], errors[0]
        assert "newest complete checkpoint" in errors[0] and "step=00000002.ckpt, is kept" in errors[0], errors[0]
        assert results[0]["disk_full"][label]["steps"] == [2], label
    assert results[0]["disk_full"]["resumed"] == ("step=00000002.ckpt", 3)


@pytest.mark.distributed
@pytest.mark.timeout(450)
def test_full_state_checkpoints_resume_exactly(results):
    full = results[0]["full_state"]
    assert full["resumed_from"] == "step=00000003.ckpt" and full["is_file"], "one file, written by rank 0"
    torch.testing.assert_close(torch.tensor(full["resumed"]), torch.tensor(full["straight"]), **EXACT)
