"""Which modules context parallelism runs on the gathered sequence, read from the traced forward's attention calls.

Training parity of the hybrid models this selects for (Falcon-H1, Bamba, Qwen3-Next, Jamba under cp2, Ulysses, ZeRO-3,
activation checkpointing and cp2 x tp2) is in tests/strategies/test_context_parallel_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llm.modeling.structure import traced_blocks
from lightning_llm.parallel.cp.gathered import gathered_mixers
from tests.zoo import _models_hybrid, _models_libraries, _models_more
from tests.zoo._models import ZooLM

pytestmark = pytest.mark.timeout(120)

for _registry in (_models_hybrid, _models_more, _models_libraries):
    _registry.register()


def _traced(name: str):
    module = ZooLM(name)
    tokens = torch.randint(0, 64, (2, 16))
    return module, traced_blocks(module, lambda move: module.training_step(move(tokens), 0))


@pytest.mark.parametrize(
    "name, attention",
    [
        ("llama", "self_attn"),  # Hugging Face's SDPA attention function
        ("torch_encoder", "self_attn"),  # nn.MultiheadAttention (F.multi_head_attention_forward)
        ("falcon_h1", "self_attn"),  # Mamba-2 beside attention: only the attention module attends
    ],
)
def test_the_traced_forward_records_the_modules_attention_runs_in(name, attention):
    _, traced = _traced(name)
    assert traced.attends == {f"{block}.{attention}" for block in traced.names}


@pytest.mark.parametrize(
    "name, gathered",
    [
        ("llama", []),
        ("falcon_h1", ["model.model.layers.0.mamba", "model.model.layers.1.mamba"]),  # beside attention
        ("bamba", ["model.model.layers.0.mamba"]),  # a Mamba-2 layer, then an attention layer
        ("qwen3_next", ["model.model.layers.0.linear_attn", "model.model.layers.2.linear_attn"]),  # gated delta-net
    ],
)
def test_the_mixers_other_than_attention_are_gathered(name, gathered):
    module, traced = _traced(name)
    blocks = [module.get_submodule(n) for n in traced.names]
    mixers = gathered_mixers(traced.names, blocks, traced.attends)
    assert [m.name for m in mixers] == gathered
    assert not any(m.whole_block for m in mixers)


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, groups=8, padding=2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class _Attention(nn.Module):
    def __init__(self, eager: bool = False, conv: bool = False) -> None:
        super().__init__()
        self.qkv, self.eager = nn.Linear(8, 24), eager
        self.conv = _Conv() if conv else None

    def forward(self, x):
        q, k, v = self.qkv(x if self.conv is None else self.conv(x)).chunk(3, dim=-1)
        if self.eager:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")), dim=-1) @ v
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class _Block(nn.Module):
    def __init__(self, *parts: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        for part in self.parts:
            x = x + part(x)
        return x


class _Model(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.embed, self.layers, self.head = nn.Embedding(32, 8), nn.ModuleList(blocks), nn.Linear(8, 32)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Holder(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.model = _Model(*blocks)


def _mixers(*blocks: nn.Module):
    holder = _Holder(*blocks)
    traced = traced_blocks(holder, lambda move: holder.model(move(torch.randint(0, 32, (2, 8)))))
    names = [f"model.layers.{i}" for i in range(len(blocks))]
    return [(m.name, m.whole_block) for m in gathered_mixers(names, list(holder.model.layers), traced.attends)]


def test_a_block_running_no_attention_call_runs_whole_on_the_gathered_sequence():
    """An eager softmax is no attention call CP can route: that block is gathered whole (exact, not split); a
    convolution held by a block that runs no attention is gathered as the block's child, or with the block when it
    is the block's direct child."""
    eager = _Block(_Attention(eager=True))
    conv_child = _Block(_Conv())
    direct = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1))
    assert _mixers(_Block(_Attention()), eager, conv_child, direct) == [
        ("model.layers.1", True),
        ("model.layers.2.parts", False),
        ("model.layers.3", True),
    ]


def test_a_child_running_attention_and_a_convolution_both_is_refused():
    with pytest.raises(ValueError, match=r"model\.layers\.0\.parts \(ModuleList\) holds both"):
        _mixers(_Block(_Attention(), _Conv()), _Block(_Attention(), _Conv()))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.parts \(ModuleList\) holds both"):
        _mixers(_Block(_Attention(conv=True)), _Block(_Attention(conv=True)))
