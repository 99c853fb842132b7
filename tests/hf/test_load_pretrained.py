"""Pretrained Hugging Face weights into sharded layouts: 10 fine-tuning steps equal single-process from_pretrained."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_llm.hf.load import load_pretrained
from lightning_llm.testing import run_distributed
from tests._optional import requires_deepspeed
from tests.hf._pretrained import finetune, finetune_deepspeed, finetune_layouts, hf_config, save


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    paths = {}
    for arch in ("llama", "qwen2"):
        paths[arch] = str(tmp_path_factory.mktemp(arch))
        save(arch, paths[arch])
    return paths


@pytest.fixture(scope="module")
def sharded_losses(saved):
    return run_distributed(finetune_layouts, 2, saved, timeout=600)[0]


@pytest.mark.parametrize("layout", ["zero3_dp2", "tp2", "pp2"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_finetune_from_pretrained_matches_single_process(saved, sharded_losses, arch, layout):
    expected = finetune(arch, saved[arch], None, 1, 8)
    got = sharded_losses[(arch, layout)]
    assert len(got) == len(expected) == 10
    assert got == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def deepspeed_losses(saved):
    return run_distributed(finetune_deepspeed, 2, saved, timeout=600)[0]


@requires_deepspeed
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_deepspeed_zero3_finetune_from_pretrained_matches_single_process(saved, deepspeed_losses, arch):
    """LLMDeepSpeedStrategy(zero_stage=3, load_pretrained=dir), dp=2, every parameter partitioned: each rank reads its
    partitions of the checkpoint; the oracle is single-process fine-tuning from from_pretrained."""
    expected = finetune(arch, saved[arch], None, 1, 8)
    got = deepspeed_losses[arch]
    assert len(got) == len(expected) == 10
    assert got == pytest.approx(expected, abs=1e-5)


@requires_deepspeed
def test_deepspeed_zero3_refuses_mismatched_checkpoint(deepspeed_losses):
    assert "unexpected ['model.layers.0.self_attn.k_proj.bias'" in deepspeed_losses["unexpected"]
    assert re.search(
        r"mis-shaped \[.*'model.layers.0.mlp.down_proj.weight: checkpoint \(64, 128\), model \(64, 96\)'",
        deepspeed_losses["mis-shaped"],
    )


def test_mismatched_checkpoint_is_refused(saved):
    import transformers

    config = hf_config("llama")
    config.num_hidden_layers = 1
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1"):
        load_pretrained(model, saved["llama"])
    config = hf_config("llama")
    config.intermediate_size = 96
    with pytest.raises(
        ValueError,
        match=r"mis-shaped \[.*'model.layers.0.mlp.down_proj.weight: checkpoint \(64, 128\), model \(64, 96\)'",
    ):
        load_pretrained(transformers.LlamaForCausalLM(config), saved["llama"])


def _copy_with(saved_dir: str, tmp_path, key: str, make) -> str:
    """The saved checkpoint with tensor ``key`` replaced by ``make(tensor)``, in a new directory."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "edited"
    shutil.copytree(saved_dir, out)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    tensors[key] = make(tensors[key])
    save_file(tensors, weights, metadata={"format": "pt"})
    return str(out)


def test_integer_tensors_into_float_weights_are_refused_naming_the_tensor_and_file(saved, tmp_path):
    import transformers

    key = "model.layers.0.mlp.up_proj.weight"
    edited = _copy_with(saved["llama"], tmp_path, key, lambda t: t.to(torch.int32))
    with pytest.raises(
        ValueError, match=rf"integer or boolean tensors .*{re.escape(key)} \(I32\) in model.safetensors"
    ):
        load_pretrained(transformers.LlamaForCausalLM(hf_config("llama")), edited)


def test_non_finite_weights_are_refused_naming_the_tensor_and_file(saved, tmp_path):
    import transformers

    key = "model.norm.weight"
    edited = _copy_with(saved["llama"], tmp_path, key, lambda t: t.index_fill(0, torch.tensor([1, 3]), float("nan")))
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{re.escape(key)}' holds 2 non-finite values"):
        load_pretrained(transformers.LlamaForCausalLM(hf_config("llama")), edited)


def test_load_pretrained_says_what_it_loaded(saved, caplog):
    import logging

    import transformers

    model = transformers.LlamaForCausalLM(hf_config("llama"))
    with caplog.at_level(logging.INFO):
        names = load_pretrained(model, saved["llama"])
    count = sum(p.numel() for p in model.parameters())
    assert f"load_pretrained: {len(names)} tensors ({count / 1e6:.1f}M parameters) from {saved['llama']}" in caplog.text
