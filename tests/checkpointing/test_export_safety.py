"""``lightning-llm export`` refuses a corrupted checkpoint, never overwrites by accident and leaves nothing partial.

The checkpoint is a committed single-file checkpoint (CheckpointRotation records each file's CRC-32 in its marker);
a flipped tensor byte is the corruption, as in the rotation's own safety tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.checkpointing import files
from lightning_llm.cli import main
from tests.callbacks.test_checkpoint_safety import fit, flip_tensor_bytes

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def committed(tmp_path):
    fit(tmp_path, 2, CheckpointRotation(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2))
    (checkpoint,) = files.complete_checkpoints(tmp_path / "ckpts")
    return Path(checkpoint)


def _export(capsys, *args) -> tuple[int, str]:
    try:
        main(["export", *map(str, args), "--format", "torch"])
    except SystemExit as exit:
        return exit.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


def test_a_corrupted_checkpoint_is_refused_unless_told_otherwise(committed, tmp_path, capsys):
    member = flip_tensor_bytes(committed)
    code, err = _export(capsys, committed, tmp_path / "out.pt")
    assert code == 1 and "does not match the checksums" in err and "--no-verify" in err
    assert not list(tmp_path.glob("*out.pt*"))  # nothing written, not even a partial file
    code, _ = _export(capsys, committed, tmp_path / "out.pt", "--no-verify")
    assert code == 0 and (tmp_path / "out.pt").is_file(), member


def test_an_existing_output_is_replaced_only_with_overwrite_and_whole(committed, tmp_path, capsys):
    out = tmp_path / "out.pt"
    out.write_bytes(b"an earlier export")
    code, err = _export(capsys, committed, out)
    assert code == 1 and f"{out} exists; pass --overwrite" in err
    assert out.read_bytes() == b"an earlier export"
    code, _ = _export(capsys, committed, out, "--overwrite")
    assert code == 0 and torch.load(out, weights_only=False)["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if "out.pt" in p.name) == ["out.pt"]  # no partial or old copy


def test_a_failed_export_leaves_the_previous_output_and_no_debris(committed, tmp_path, capsys, monkeypatch):
    import lightning_llm.export as export

    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")  # an earlier export's index

    def fails(options):
        Path(options.output).mkdir()
        (Path(options.output) / "half-written").write_text("x")
        raise ValueError("the export failed halfway")

    monkeypatch.setattr(export, "_export", fails)
    code, err = _export(capsys, committed, out, "--overwrite")
    assert code == 1 and "failed halfway" in err
    assert [p.name for p in out.iterdir()] == ["model.safetensors.index.json"]  # the previous output, untouched
    assert sorted(p.name for p in tmp_path.iterdir() if "hf" in p.name) == ["hf"]  # no partial directory left


def test_a_truncated_commit_marker_is_said_and_refused_not_taken_for_none(committed):
    from lightning_llm.checkpointing import checksums

    marker = Path(files.marker_path(str(committed)))
    marker.write_text(marker.read_text()[:20])  # a write cut short
    with pytest.warns(UserWarning, match=r"is skipped: its commit marker .* is not valid JSON"):
        assert files.complete_checkpoints(committed.parent) == []
    assert "is not valid JSON" in checksums.refusal(str(committed))
