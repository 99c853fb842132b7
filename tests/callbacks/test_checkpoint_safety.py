"""Checkpoints are never silently wrong (issue 14, items 2-5 and 7): content checksums with a verified fallback for
ckpt_path="last" and a refusal for an explicit path; save failures (a full disk, injected or a real small tmpfs)
raised as one clear error that keeps the older checkpoint; strict loading; a monitor that is never logged.

The 2-rank cases (ZeRO-3 sharded checkpoints, DDP) share one spawn: ``tests/strategies/test_checkpoint_loading.py``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io import TorchCheckpointIO

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.checkpointing import checksums, files
from tests.strategies._parity import data, make_model


def fit(root, steps, callback=None, ckpt_path=None, model=None, plugins=(), **trainer_kwargs):
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback] if callback else [],
        default_root_dir=root,
        num_sanity_val_steps=0,
        plugins=list(plugins),
        **{"limit_val_batches": 0, **trainer_kwargs},
    )
    trainer.fit(model or make_model("reference"), data(8), ckpt_path=ckpt_path)
    return trainer


def steps_in(directory) -> list[int]:
    return [files.read_marker(p)["step"] for p in files.complete_checkpoints(Path(directory))]


def flip_tensor_bytes(archive: Path) -> str:
    """Invert 64 bytes in the middle of the largest tensor's data inside a torch archive; return the member name."""
    with zipfile.ZipFile(archive) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(archive.read_bytes())
    # Local file header: 30 bytes, then the name and the extra field, whose lengths sit at bytes 26-29.
    start = (
        info.header_offset
        + 30
        + int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
        + int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    )
    middle = start + info.file_size // 2
    raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    archive.write_bytes(bytes(raw))
    return info.filename


def test_checksums_recorded_per_file_match_an_independent_crc(tmp_path):
    fit(tmp_path, 2, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2))
    (checkpoint,) = files.complete_checkpoints(tmp_path)
    import zlib

    recorded = files.read_marker(checkpoint)["checksums"]
    raw = Path(checkpoint).read_bytes()
    assert recorded == {".": {"size": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}}


def test_flipped_tensor_bytes_fall_back_to_the_older_checkpoint_and_refuse_the_explicit_path(tmp_path):
    fit(tmp_path, 4, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=5))
    newest = tmp_path / "step=00000004.ckpt"
    before = torch.load(newest, weights_only=True)["state_dict"]
    flip_tensor_bytes(newest)
    after = torch.load(newest, weights_only=True)["state_dict"]  # torch loads the corrupted file without a word
    assert any(not torch.equal(before[k], after[k]) for k in before), "the flip landed in tensor data"
    with pytest.warns(UserWarning, match=r"'last' skips .*step=00000004.ckpt.*CRC-32 .* \(content corrupted\)"):
        trainer = fit(tmp_path, 5, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=100), ckpt_path="last")
    assert Path(trainer.ckpt_path).name == "step=00000002.ckpt"
    with pytest.raises(ValueError, match=r"ckpt_path='.*step=00000004.ckpt' cannot be resumed from: .*content corr"):
        fit(tmp_path, 6, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=100), ckpt_path=str(newest))


def test_truncated_newest_checkpoint_falls_back(tmp_path):
    fit(tmp_path, 4, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=5))
    newest = tmp_path / "step=00000004.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with pytest.warns(UserWarning, match=r"'last' skips .*step=00000004.ckpt.*truncated"):
        trainer = fit(tmp_path, 5, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=100), ckpt_path="last")
    assert Path(trainer.ckpt_path).name == "step=00000002.ckpt" and trainer.global_step == 5


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    fit(tmp_path, 2, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2))
    flip_tensor_bytes(tmp_path / "step=00000002.ckpt")
    failure = r"every checkpoint in .* fails verification \(\['step=00000002.ckpt'\]\)"
    with pytest.raises(RuntimeError, match=failure), pytest.warns(UserWarning, match="skips"):
        fit(tmp_path, 3, CheckpointRotation(dirpath=str(tmp_path)), ckpt_path="last")


class FullDisk(TorchCheckpointIO):
    """Writes part of the file, then fails as a full disk does (the write of a checkpoint after the first);
    with ``code=errno.EACCES``, as a directory that became read-only does."""

    def __init__(self, code: int = errno.ENOSPC) -> None:
        self.saves, self.code = 0, code

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saves += 1
        if self.saves == 1:
            return super().save_checkpoint(checkpoint, path, storage_options)
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(self.code, os.strerror(self.code), str(path))


@pytest.mark.parametrize(
    ("async_save", "code", "cause"),
    [
        (False, errno.ENOSPC, "no space left on the device (ENOSPC"),
        (True, errno.ENOSPC, "no space left on the device (ENOSPC"),
        (False, errno.EACCES, "permission denied (EACCES"),
    ],
    ids=["sync-full", "async-full", "sync-permission"],
)
def test_injected_save_failure_is_one_clear_error_and_the_older_checkpoint_loads(tmp_path, async_save, code, cause):
    rotation = CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, keep_last=1, async_save=async_save)
    with pytest.raises(RuntimeError) as raised:
        fit(tmp_path, 6, rotation, plugins=[FullDisk(code)])
    message = str(raised.value)
    assert f"could not save checkpoint step=00000004.ckpt in {tmp_path}: {cause}" in message
    assert f"the newest complete checkpoint, {tmp_path / 'step=00000002.ckpt'}, is kept" in message
    assert steps_in(tmp_path) == [2] and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    trainer = fit(tmp_path, 3, CheckpointRotation(dirpath=str(tmp_path)), ckpt_path="last")
    assert trainer.global_step == 3 and Path(trainer.ckpt_path).name == "step=00000002.ckpt"


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (room for one ~1.6 MB checkpoint, not two), where the machine lets us mount one; else None."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, check=False
    ).returncode:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_real_full_disk_on_a_small_tmpfs_or_injected(tmp_path, small_disk):
    """torch's own writer on a full disk says "unexpected pos ..."; the error must say the disk is full."""
    directory = small_disk or tmp_path
    plugins = [] if small_disk else [FullDisk()]  # no mount permission: the same failure, injected
    with pytest.raises(
        RuntimeError,
        match=rf"could not save checkpoint step=00000004.ckpt in {directory}: .*no space"
        r".*newest complete checkpoint, .*step=00000002.ckpt, is kept",
    ):
        fit(
            tmp_path, 6, CheckpointRotation(dirpath=str(directory), every_n_train_steps=2, keep_last=1), plugins=plugins
        )
    (kept,) = files.complete_checkpoints(directory)
    checksums.verify_committed(kept)
    assert torch.load(kept, weights_only=True)["global_step"] == 2


def test_monitor_never_logged_raises_at_the_first_save_unless_opted_out(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"monitor='val_acc'\): no metric 'val_acc' was logged by step 2; the "
        r"logged metrics are \['train_loss', 'train_ppl'\]",
    ):
        fit(tmp_path, 4, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2, monitor="val_acc"))
    assert steps_in(tmp_path) == [], "refused before writing anything"
    # With validation that has not run yet, a validation metric may still come: a warning, no score.
    rotation = CheckpointRotation(dirpath=str(tmp_path / "v"), every_n_train_steps=2, monitor="val_loss")
    with pytest.warns(UserWarning, match="Validation has not run yet"):
        fit(tmp_path, 2, rotation, limit_val_batches=1, val_check_interval=4)
    # ...but once it ran and the metric is still missing, that is an error.
    with pytest.raises(
        ValueError, match="no metric 'val_typo' was logged by step 4; the logged metrics are .*val_loss"
    ):
        fit(
            tmp_path,
            6,
            CheckpointRotation(dirpath=str(tmp_path / "w"), every_n_train_steps=4, monitor="val_typo"),
            limit_val_batches=1,
            val_check_interval=2,
        )
    rotation = CheckpointRotation(
        dirpath=str(tmp_path / "o"), every_n_train_steps=2, monitor="val_acc", require_monitor=False
    )
    fit(tmp_path, 2, rotation)
    assert steps_in(tmp_path / "o") == [2] and "score" not in files.read_marker(tmp_path / "o/step=00000002.ckpt")


def test_single_device_loading_is_strict_both_ways_with_strict_loading_as_the_opt_out(tmp_path):
    fit(tmp_path, 2, CheckpointRotation(dirpath=str(tmp_path), every_n_train_steps=2))
    saved = tmp_path / "step=00000002.ckpt"
    rotation = CheckpointRotation(dirpath=str(tmp_path / "one"))
    with pytest.raises(
        RuntimeError,
        match=r"does not fit the model: in the checkpoint but not in the model: 9 "
        r"\(model\.layers\.1\..*and 4 more\).*strict_loading = False",
    ):
        fit(tmp_path, 2, rotation, ckpt_path=str(saved), model=make_model("reference", layers=1))
    lenient = make_model("reference", layers=1)
    lenient.strict_loading = False
    with pytest.warns(UserWarning, match="only the tensors both have with equal shapes are loaded"):
        fit(tmp_path, 2, CheckpointRotation(dirpath=str(tmp_path / "one")), ckpt_path=str(saved), model=lenient)
    reference = torch.load(saved, weights_only=True)["state_dict"]  # oracle: the file as torch reads it
    for name, tensor in lenient.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


def test_a_sharded_directory_given_to_a_single_file_strategy_is_named_before_any_step(tmp_path):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"")  # what a DCP checkpoint directory holds
    callback = CheckpointRotation(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)
    with pytest.raises(ValueError, match="is a directory") as error:
        fit(tmp_path, 2, callback, ckpt_path=str(sharded))
    assert str(sharded) in str(error.value) and "python -m lightning_llm.checkpoint" in str(error.value)
    assert steps_in(tmp_path / "ckpt") == [], "no training step ran, so nothing was saved"
