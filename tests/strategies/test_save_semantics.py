"""``LLMParallelStrategy.save_checkpoint`` follows Lightning's ``ModelParallelStrategy`` rules, on real files.

The cases of Lightning 2.6.5's ``test_save_checkpoint_path_exists`` and ``test_save_checkpoint_storage_options``
(``tests_pytorch/strategies/test_model_parallel.py``), checked on disk instead of through mocks, plus a save with
no LightningModule attached (Lightning's works). One process, no process group: the rules are rank 0's.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.checkpointing.errors import SaveFailed
from lightning_llm.strategies import LLMParallelStrategy


def _checkpoint() -> dict:
    return {"state_dict": {"w": torch.arange(4.0)}, "optimizer_states": [], "epoch": 3}


def test_storage_options_are_refused_as_lightning_does(tmp_path):
    with pytest.raises(TypeError, match=r"LLMParallelStrategy.save_checkpoint\(..., storage_options=...\)` is not"):
        LLMParallelStrategy().save_checkpoint(_checkpoint(), tmp_path / "a.ckpt", storage_options={"anon": True})


def test_a_full_file_save_keeps_lightnings_overwrite_rules_and_error_type(tmp_path):
    strategy = LLMParallelStrategy(save_distributed_checkpoint=False)
    # Onto a directory that is not a sharded checkpoint: IsADirectoryError (also our SaveFailed), nothing removed.
    folder = tmp_path / "not-empty"
    folder.mkdir()
    (folder / "file").touch()
    with pytest.raises(IsADirectoryError, match="exists and is a directory") as raised:
        strategy.save_checkpoint(_checkpoint(), folder)
    assert isinstance(raised.value, SaveFailed) and (folder / "file").exists()
    # Onto a sharded checkpoint: replaced by the file.
    sharded = tmp_path / "sharded"
    LLMParallelStrategy().save_checkpoint(_checkpoint(), sharded)
    assert (sharded / ".metadata").is_file()
    strategy.save_checkpoint(_checkpoint(), sharded)
    assert sharded.is_file() and torch.equal(
        torch.load(sharded, weights_only=True)["state_dict"]["w"], torch.arange(4.0)
    )
    # Onto a file: overwritten.
    file = tmp_path / "file.ckpt"
    file.write_bytes(b"old")
    strategy.save_checkpoint(_checkpoint(), file)
    assert torch.load(file, weights_only=True)["epoch"] == 3


def test_a_sharded_save_replaces_a_file_and_writes_into_an_existing_directory(tmp_path):
    strategy = LLMParallelStrategy(save_distributed_checkpoint=True)
    folder = tmp_path / "not-empty"
    folder.mkdir()
    (folder / "file").touch()
    strategy.save_checkpoint(_checkpoint(), folder)
    assert (folder / "file").exists() and (folder / ".metadata").is_file() and (folder / "meta.pt").is_file()
    file = tmp_path / "file.ckpt"
    file.write_bytes(b"old")
    strategy.save_checkpoint(_checkpoint(), file)
    assert file.is_dir() and (file / ".metadata").is_file()
    assert torch.load(file / "meta.pt", weights_only=True)["epoch"] == 3
