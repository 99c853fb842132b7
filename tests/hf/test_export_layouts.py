"""Checkpoints saved by Lightning under dp2 ZeRO-3, tp2 and pp2 export to Hugging Face directories that compute
what the trained model computed.

One 2-rank spawn trains every case a few steps (HF Llama, HF Qwen2 with tied embeddings, the reference
CausalLM; DCP directories and one single file) and returns, per case, the trained model's logits in its layout
(not under pp, whose stages cannot run a whole forward outside the schedule) and its full parameters. Each
export is loaded back with ``transformers.AutoModelForCausalLM.from_pretrained`` and its logits compared with
both, fp32, within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.checkpoint import consolidate_checkpoint
from lightning_llm.hf import export_hf
from lightning_llm.testing import run_distributed
from tests.hf._export import CASES, TOKENS, logits_of, make_module, train_and_save_all

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
IDS = [f"{arch}-{layout}{'-file' if single else ''}" for arch, layout, single in CASES]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_distributed(train_and_save_all, 2, str(tmp_path_factory.mktemp("ckpts")), timeout=840)[0]


def _hf_logits(directory) -> tuple[torch.Tensor, torch.nn.Module]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float(), model


def _oracle_logits(arch: str, state: dict) -> torch.Tensor:
    """The trained parameters (gathered from the ranks) in a fresh single-process module of the same class."""
    module = make_module(arch)
    module.load_state_dict(state)
    return logits_of(module, TOKENS)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_export_hf_computes_the_trained_model(trained, case, tmp_path):
    arch, layout, _ = case
    result = trained[case]
    got, model = _hf_logits(export_hf(result["path"], tmp_path / "hf"))
    assert model.dtype == torch.float32
    oracle = _oracle_logits(arch, result["state"])
    difference = (got - oracle).abs().max().item()
    print(f"{arch} {layout}: max |logit difference| vs gathered parameters {difference:.2e}", end="")
    assert difference <= 1e-5
    if result["logits"] is not None:
        in_layout = (got - result["logits"]).abs().max().item()
        print(f", vs the model in its layout {in_layout:.2e}", end="")
        assert in_layout <= 1e-5
    if arch == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bf16_export_is_the_fp32_export_rounded(trained, tmp_path):
    from safetensors.torch import load_file

    path = trained[("qwen2", "pp2", False)]["path"]
    full = load_file(export_hf(path, tmp_path / "fp32") / "model.safetensors")
    half = load_file(export_hf(path, tmp_path / "bf16", dtype="bfloat16") / "model.safetensors")
    assert full.keys() == half.keys()
    for name, tensor in full.items():
        assert half[name].dtype == torch.bfloat16 and torch.equal(half[name], tensor.to(torch.bfloat16)), name
    _, model = _hf_logits(tmp_path / "bf16")
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("case", [("llama", "tp2", False), ("llama", "zero3_dp2", True)], ids=["dcp-dir", "file"])
def test_torch_export_is_the_full_lightning_checkpoint(trained, case, tmp_path):
    result = trained[case]
    state = torch.load(consolidate_checkpoint(result["path"], tmp_path / "full.pt"), weights_only=False)
    assert state["global_step"] == 3 and ("optimizer_0" in state or "optimizer_states" in state)
    assert state["hf_export"]["kind"] == "transformers"
    assert state["state_dict"].keys() == result["state"].keys()
    for name, tensor in result["state"].items():
        torch.testing.assert_close(state["state_dict"][name], tensor, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    bf16 = torch.load(consolidate_checkpoint(result["path"], tmp_path / "bf16.pt", dtype="bfloat16"), weights_only=False)
    assert all(bf16["state_dict"][k].dtype == torch.bfloat16 for k in result["state"])
