import math

import pytest
import torch
import torch.nn.functional as F

from lightning_llm.models import PRESETS, Llama, LlamaConfig


def reference_forward(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Meta's original Llama math written out longhand: complex RoPE, explicit causal mask, repeated KV heads."""
    cfg = model.config
    d = cfg.head_dim
    batch, seq = tokens.shape
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    rot = torch.polar(torch.ones(seq, d // 2), torch.outer(torch.arange(seq).float(), freqs))

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    def rope(x):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * rot[None, :, None, :]).flatten(-2)

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = model.tok_embeddings.weight[tokens]
    for layer in model.layers:
        a = layer.attention
        x = rms(h, layer.attention_norm.weight)
        q = rope((x @ a.q_proj.weight.T).view(batch, seq, cfg.n_heads, d))
        k = rope((x @ a.k_proj.weight.T).view(batch, seq, cfg.n_kv_heads, d))
        v = (x @ a.v_proj.weight.T).view(batch, seq, cfg.n_kv_heads, d)
        k = k.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=2)
        v = v.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d) + mask
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(batch, seq, -1)
        h = h + out @ a.o_proj.weight.T
        f = layer.feed_forward
        x = rms(h, layer.ffn_norm.weight)
        h = h + (F.silu(x @ f.gate_proj.weight.T) * (x @ f.up_proj.weight.T)) @ f.down_proj.weight.T
    return rms(h, model.norm.weight) @ model.output.weight.T


@pytest.mark.parametrize("tie", [False, True])
def test_forward_and_gradients_match_longhand_reference(tie):
    model = Llama(LlamaConfig.from_name("tiny", tie_embeddings=tie))
    with torch.no_grad():  # non-trivial norm weights, so a dropped norm weight would show
        for layer in model.layers:
            layer.attention_norm.weight.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 256, (2, 24))
    targets = torch.randint(0, 256, (2, 24))

    logits = model(tokens)
    expected = reference_forward(model, tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)

    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref_loss = F.cross_entropy(reference_forward(model, tokens).flatten(0, 1), targets.flatten())
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_initial_loss_is_log_vocab():
    model = Llama(LlamaConfig.from_name("tiny"))
    tokens = torch.randint(0, 256, (4, 32))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(256)) < 0.1


def test_tied_embeddings_share_storage():
    model = Llama(LlamaConfig.from_name("tiny", tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_parameters() == sum(p.numel() for p in set(model.parameters()))


@pytest.mark.parametrize("name, billions", [("1B", 1.24), ("7B", 6.74), ("70B", 70.55)])
def test_large_presets_build_on_meta_with_published_sizes(name, billions):
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name(name))
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_config_validation_names_the_numbers():
    with pytest.raises(ValueError, match="n_heads=6 must be divisible by n_kv_heads=4"):
        LlamaConfig(dim=48, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="Unknown model preset 'huge'"):
        LlamaConfig.from_name("huge")
    assert set(PRESETS) >= {"tiny", "1B", "7B"}
