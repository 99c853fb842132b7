"""Checkpoints saved by Lightning under dp2 ZeRO-3, tp2, pp2 and expert parallelism export to Hugging Face
directories that compute what the trained model computed.

One 2-rank spawn trains every case a few steps (HF Llama, HF Qwen2 with tied embeddings, the reference
CausalLM; DCP directories and one single file; HF Qwen3-MoE under ep2, each rank holding half of every layer's
stacked experts, exported in the model's own whole-expert layout) and returns, per case, the trained model's logits in its layout
(not under pp, whose stages cannot run a whole forward outside the schedule) and its full parameters. Each
export is loaded back with ``transformers.AutoModelForCausalLM.from_pretrained`` and its logits compared with
both, fp32, within 1e-5. The same spawn loads a Hugging Face Llama directory into the sharded reference
model (the inverse map).
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.checkpointing.consolidate import consolidate_checkpoint
from lightning_llm.hf import export_hf
from lightning_llm.testing import run_distributed
from tests.hf._export import CASES, TOKENS, logits_of, make_module, train_and_save_all

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
IDS = [f"{arch}-{layout}{'-file' if single else ''}" for arch, layout, single in CASES]


@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory):
    """A Hugging Face Llama directory (tied embeddings, rope_theta 500) of the reference model's shape."""
    import transformers

    from lightning_llm.hf.llama_map import to_hf_config
    from lightning_llm.models import LlamaConfig

    torch.manual_seed(2)
    path = tmp_path_factory.mktemp("hf_llama")
    config = LlamaConfig.from_name("tiny", rope_theta=500.0, tie_embeddings=True)
    transformers.LlamaForCausalLM(to_hf_config(config)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hf_llama_dir):
    return run_distributed(
        train_and_save_all, 2, str(tmp_path_factory.mktemp("ckpts")), str(hf_llama_dir), timeout=840
    )[0]


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
    print(
        f"{arch} {layout}{' (file)' if case[2] else ''}: max |logit difference| vs gathered parameters {difference:.2e}",
        end="",
    )
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
    bf16 = torch.load(
        consolidate_checkpoint(result["path"], tmp_path / "bf16.pt", dtype="bfloat16"), weights_only=False
    )
    assert all(bf16["state_dict"][k].dtype == torch.bfloat16 for k in result["state"])


@pytest.mark.parametrize("layout", ["zero3_dp2", "tp2"])
def test_hf_llama_loads_into_the_sharded_reference_model(trained, hf_llama_dir, layout):
    """The inverse map through the strategy's ``load_pretrained``: each rank permutes q/k rows, then keeps its shard."""
    import transformers

    from lightning_llm.hf import load_pretrained
    from lightning_llm.hf.llama_map import from_hf_config
    from lightning_llm.models.llama import Llama

    single = Llama(from_hf_config(transformers.AutoConfig.from_pretrained(hf_llama_dir)))
    load_pretrained(single, hf_llama_dir)
    sharded = trained[("load_reference", layout)]
    assert sharded.keys() == {f"model.{k}" for k in single.state_dict()}
    for name, tensor in single.state_dict().items():
        assert torch.equal(sharded[f"model.{name}"], tensor), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_llama_dir)
    with torch.no_grad():
        assert (single(TOKENS) - hf(input_ids=TOKENS).logits).abs().max() <= 1e-5
