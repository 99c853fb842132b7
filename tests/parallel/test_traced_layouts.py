"""Fused projections of unknown layout, read off one fake forward of the model: the parts the model cuts the output
into (``fused_colwise:A,B,...``), or heads stored one after another (``colwise``). The plan is checked against the
layout the model's forward really uses, written out by hand; no processes needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.parallel.parallelize import plan_tensor_parallel

WIDTH, HEADS, VOCAB = 32, 4, 64


class _Attention(nn.Module):
    """Multi-head attention with one fused projection, consumed as ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.num_heads, self.how = HEADS, how
        self.Wqkv, self.out_proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.Wqkv(x).clamp(-8, 8)  # element-wise ops before the cut are followed (DBRX clamps)
        if self.how == "chunk":  # [q | k | v] (MPT)
            q, k, v = (p.view(b, t, HEADS, -1).transpose(1, 2) for p in qkv.chunk(3, dim=-1))
        elif self.how == "heads":  # [q0 k0 v0 | q1 k1 v1 | ...] (Persimmon, Bloom)
            q, k, v = qkv.view(b, t, HEADS, 3, -1).unbind(3)
            q, k, v = (p.transpose(1, 2) for p in (q, k, v))
        else:  # a slice: nothing this package can split by
            q = k = v = qkv[..., :WIDTH].view(b, t, HEADS, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out_proj(out.transpose(1, 2).flatten(-2))


class _Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(_Attention(how) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _plan(module: nn.Module) -> dict[str, str]:
    name, blocks = find_blocks(module)
    return plan_tensor_parallel(module, tp=2, blocks_name=name, blocks=blocks, user_plan=None)[0]


@pytest.mark.parametrize(
    "how, style", [("chunk", "fused_colwise:32,32,32"), ("heads", "colwise")], ids=["q|k|v", "per-head"]
)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_fused_projection_gets_the_layout_the_forward_uses(how, style, device):
    with torch.device(device):
        module = _Net(how)
    assert _plan(module)["layers.*.Wqkv"] == style


def test_a_layout_the_forward_does_not_show_stays_refused_with_the_entry_that_splits_it():
    with pytest.raises(ValueError, match=r"would leave 'layers\.\*\.Wqkv'.*fused projection"):
        _plan(_Net("slice"))


class _WideInputAttention(nn.Module):
    """Zamba2's shared attention: q reads the residual and the embeddings side by side (twice the width) and writes
    one width of heads, so by shape it looks like an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(2 * WIDTH, WIDTH),
            nn.Linear(WIDTH, WIDTH),
            nn.Linear(WIDTH, WIDTH),
        )
        self.o_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        wide = torch.cat([x, x], dim=-1)
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in (self.q_proj(wide), self.k_proj(x), self.v_proj(x)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o_proj(out.transpose(1, 2).flatten(-2))


class _WideInputBlock(nn.Module):
    """The attention above, then a gated MLP: most layers read the block's width, as in Zamba2's hybrid layer."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _WideInputAttention()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(WIDTH, 48), nn.Linear(WIDTH, 48), nn.Linear(48, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x)
        return x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_an_input_projection_wider_than_the_block_is_split_as_the_forward_uses_it():
    module = _Net("chunk")
    for index in range(len(module.layers)):
        module.layers[index] = _WideInputBlock()
    plan = _plan(module)  # by shape alone q (64 -> 32, in a block most of whose layers read 32) is a row split
    assert [plan[f"layers.*.attn.{name}"] for name in ("q_proj", "k_proj", "v_proj")] == ["colwise"] * 3
    assert (plan["layers.*.attn.o_proj"], plan["layers.*.gate_proj"], plan["layers.*.down_proj"]) == (
        "rowwise",
        "colwise",
        "rowwise",
    )
