"""``lightning-llm export`` end to end on a checkpoint saved by Lightning's own strategy (one process, one file):
no record of the Hugging Face model in it, so ``--format hf`` is refused with the fix, and works with ``--hf_config``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import LLMDataModule
from lightning_llm.hf import export_hf
from lightning_llm.testing import cpu_trainer
from tests.hf._export import TOKENS, logits_of
from tests.hf._pretrained import PretrainedLM

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint file, HF config dir, trained module): HF Llama trained 2 steps, saved by trainer.save_checkpoint."""
    root = tmp_path_factory.mktemp("plain")
    torch.manual_seed(0)
    module = PretrainedLM("llama")
    trainer = cpu_trainer(
        devices=1,
        max_steps=2,
        limit_val_batches=0,
    )
    trainer.fit(module, LLMDataModule(num_tokens=5_000, seq_len=24, batch_size=2, seed=3))
    trainer.save_checkpoint(root / "plain.ckpt")
    module.model.config.save_pretrained(root / "config")
    return root / "plain.ckpt", root / "config", module


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_llm.cli", "export", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


def test_checkpoint_without_model_record_is_refused_with_the_fix(saved, tmp_path):
    checkpoint, _, _ = saved
    with pytest.raises(ValueError, match=r"does not say which Hugging Face model.*--hf_config DIR"):
        export_hf(checkpoint, tmp_path / "hf")
    result = _cli(checkpoint, tmp_path / "hf", "--format", "hf")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "lightning-llm export: error:" in result.stderr and "--hf_config DIR" in result.stderr
    assert not (tmp_path / "hf").exists()


def test_hf_export_with_hf_config_prints_only_its_path(saved, tmp_path):
    import transformers

    checkpoint, config_dir, module = saved
    result = _cli(checkpoint, tmp_path / "hf", "--format", "hf", "--hf_config", config_dir, "--max_shard_size", "100KB")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == f"{tmp_path / 'hf'}\n"
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # ~430 KB of fp32 weights: several files
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        difference = (model(input_ids=TOKENS).logits - logits_of(module, TOKENS)).abs().max().item()
    assert difference <= 1e-5


def test_torch_export_of_a_file_and_the_module_alias(saved, tmp_path, capsys):
    checkpoint, _, module = saved
    main(["export", str(checkpoint), str(tmp_path / "full.pt"), "--format", "torch", "--dtype", "bfloat16"])
    assert capsys.readouterr().out == f"{tmp_path / 'full.pt'}\n"
    state = torch.load(tmp_path / "full.pt", weights_only=False)
    assert state["global_step"] == 2
    for name, tensor in module.state_dict().items():
        assert torch.equal(state["state_dict"][name], tensor.to(torch.bfloat16)), name
    result = subprocess.run(
        [sys.executable, "-m", "lightning_llm.checkpoint", str(checkpoint), str(tmp_path / "a.pt")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert result.returncode == 0 and result.stdout == f"{tmp_path / 'a.pt'}\n", result.stderr[-2000:]
    assert torch.load(tmp_path / "a.pt", weights_only=False)["state_dict"].keys() == module.state_dict().keys()


def test_bad_arguments_are_refused(saved, tmp_path):
    checkpoint, config_dir, _ = saved
    with pytest.raises(SystemExit):
        main(["export", str(checkpoint), str(tmp_path / "x.pt"), "--format", "torch", "--hf_config", str(config_dir)])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_hf(tmp_path / "missing", tmp_path / "hf")
    with pytest.raises(FileNotFoundError, match="--hf_config"):
        export_hf(checkpoint, tmp_path / "hf", hf_config=tmp_path)
