"""The reference Llama <-> Hugging Face LlamaForCausalLM map, both ways, on logits (single process, fp32).

The rotary permutation is decided by the numbers: without it the exported model's logits differ
(the reference rotates interleaved channel pairs, Hugging Face rotates halves), with it they agree.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.data import LLMDataModule
from lightning_llm.hf import export_hf, llama_map, load_pretrained
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.models.llama import Llama
from lightning_llm.testing import cpu_trainer

pytestmark = pytest.mark.timeout(120)
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


def _config(tie: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie
    )


def _logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def test_rotary_rows_must_be_permuted():
    import transformers

    torch.manual_seed(0)
    config = _config(tie=False)
    reference = Llama(config)
    hf = transformers.LlamaForCausalLM(llama_map.to_hf_config(config))
    hf.load_state_dict({llama_map.to_hf_name(k): v for k, v in reference.state_dict().items()})
    assert (_logits(hf) - _logits(reference)).abs().max() > 1e-4  # names alone are not enough
    hf.load_state_dict(
        {llama_map.to_hf_name(k): llama_map.to_hf_tensor(k, v, config) for k, v in reference.state_dict().items()}
    )
    assert (_logits(hf) - _logits(reference)).abs().max() <= 1e-5
    for name, tensor in reference.state_dict().items():
        back = llama_map.from_hf_tensor(name, llama_map.to_hf_tensor(name, tensor, config), config)
        assert llama_map.from_hf_name(llama_map.to_hf_name(name)) == name and torch.equal(back, tensor)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_reference_checkpoint_exports_to_hf(tmp_path, tie):
    """CausalLM trained 2 steps and saved by Lightning's own strategy: no hf_export entry, its hyperparameters say."""
    import transformers

    torch.manual_seed(0)
    module = CausalLM(_config(tie), learning_rate=1e-2, warmup_steps=1, max_steps=2)
    trainer = cpu_trainer(
        devices=1,
        max_steps=2,
        limit_val_batches=0,
    )
    trainer.fit(module, LLMDataModule(num_tokens=5_000, seq_len=24, batch_size=2, seed=3))
    trainer.save_checkpoint(tmp_path / "ref.ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "ref.ckpt", tmp_path / "hf"))
    assert isinstance(hf, transformers.LlamaForCausalLM)
    with torch.no_grad():
        difference = (hf(input_ids=TOKENS).logits - module.model(TOKENS)).abs().max()
    print(f"reference -> HF ({'tied' if tie else 'untied'}): max |logit difference| {difference.item():.2e}")
    assert difference <= 1e-5
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tie


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_llama_directory_loads_into_the_reference_model(tmp_path, tie):
    import transformers

    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(llama_map.to_hf_config(_config(tie)))
    hf.save_pretrained(tmp_path)
    reference = Llama(llama_map.from_hf_config(transformers.AutoConfig.from_pretrained(tmp_path)))
    load_pretrained(reference, tmp_path)
    difference = (_logits(reference) - _logits(hf)).abs().max()
    print(f"HF -> reference ({'tied' if tie else 'untied'}): max |logit difference| {difference.item():.2e}")
    assert difference <= 1e-5
    assert (reference.output.weight is reference.tok_embeddings.weight) == tie


def test_hf_config_computing_something_else_is_refused(tmp_path):
    import transformers

    transformers.LlamaForCausalLM(llama_map.to_hf_config(_config(False))).save_pretrained(tmp_path)
    reference = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, norm_eps=1e-6))
    with pytest.raises(ValueError, match=r"rope_theta': \(10000.0, 500.0\).*from_hf_config"):
        load_pretrained(reference, tmp_path)
