"""The first-forward watch on column-split layers: a block that cuts such a layer's output into parts along its
last dimension is refused before the cut runs; reshaping it into heads (what a column split is right for) passes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_llm.parallel.tp.split_outputs import watch_first_forward


class _Mixer(nn.Module):
    """A fused input projection, then ``how`` it is consumed."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.in_proj, self.how = nn.Linear(8, 12), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.in_proj(x)
        if self.how == "split":
            a, b = y.split([8, 4], dim=-1)  # a state-space mixer's x | dt, sizes from its config
            return a + b.sum(-1, keepdim=True)
        if self.how == "chunk":
            gate, up = y.chunk(2, dim=-1)
            return (gate * up).sum(-1, keepdim=True).expand(*x.shape)
        if self.how == "slicing":
            return y[..., :8]
        return y.view(*y.shape[:-1], 3, 4).sum(-2)[..., :4].repeat(1, 1, 2)  # heads: a column split is right


@pytest.mark.parametrize("how", ["split", "chunk", "slicing"])
def test_a_column_split_output_cut_into_parts_is_refused_at_the_first_forward(how):
    block = _Mixer(how)
    watch_first_forward(block, ["in_proj"], "model.layers.3")
    cut = {"split": "split_with_sizes|split", "chunk": "chunk", "slicing": "slicing"}[how]
    with pytest.raises(RuntimeError) as raised:
        block(torch.randn(2, 5, 8))
    message = str(raised.value)
    assert re.search(
        rf"model.layers.3.in_proj is split column-wise \('colwise'\), but the model cuts its output into parts "
        rf"\(({cut}) along the last dimension; this rank holds 12 of its columns\)",
        message,
    ), message
    # the entries that work: the parts' sizes per head, or the whole mixer kept whole
    assert "{'model.layers.3.in_proj': 'fused_colwise:A,B,...'}" in message
    assert "tensor_parallel_replicate=['model.layers.3']" in message


def test_heads_pass_and_the_watch_leaves_after_the_first_forward():
    block = _Mixer("heads")
    watch_first_forward(block, ["in_proj"], "model.layers.0")
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(block(x), _Mixer.forward(block, x))
    assert not block._forward_hooks and not block._forward_pre_hooks and not block.in_proj._forward_hooks


class _Differential(nn.Module):
    """DiffLlama's value path: heads from a column-split projection, then the heads cut into two halves (which
    pairs head i with head i + n/2: under a split by heads a rank would pair its own heads instead)."""

    def __init__(self, cut_heads: bool) -> None:
        super().__init__()
        self.v_proj, self.cut_heads = nn.Linear(8, 16), cut_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.v_proj(x).view(*x.shape[:-1], 4, 4).transpose(1, 2).contiguous()  # (batch, heads, seq, head_dim)
        if self.cut_heads:
            v = torch.cat([v.new_zeros(*v.shape[:2], 0, 4), v], dim=2)  # a KV cache appends along the sequence
            first, second = torch.chunk(v, 2, dim=1)
            return (first - second).sum((1, 3))[..., None].expand(*x.shape)
        rope, rest = v.split([2, 2], dim=-1)  # a head's own columns (latent attention's rope | nope): fine
        return (rope * rest).sum((1, 3))[..., None].expand(*x.shape)


def test_heads_cut_into_groups_are_refused_and_a_heads_own_columns_pass():
    block = _Differential(cut_heads=True)
    watch_first_forward(block, ["v_proj"], "model.layers.2")
    with pytest.raises(
        RuntimeError,
        match=r"model\.layers\.2\.v_proj is split column-wise by heads \(this rank holds 4 of them\), but the model cuts its heads into groups \(chunk along the head axis",
    ) as raised:
        block(torch.randn(2, 5, 8))
    assert "tensor_parallel_replicate=['model.layers.*']" in str(raised.value)
    fine = _Differential(cut_heads=False)
    watch_first_forward(fine, ["v_proj"], "model.layers.2")
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(fine(x), _Differential.forward(fine, x))


class _PerHeadNorms(nn.Module):
    """StableLM 2's per-head q norms: the heads cut one by one, each normalized by its own LayerNorm, put back in
    order (``per_head``); or two heads' pieces combined (``paired``), which pairs heads across the split."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.q_proj, self.how = nn.Linear(8, 16), how
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(*x.shape[:-1], 4, 4).transpose(1, 2)  # (batch, heads, seq, head_dim)
        pieces = torch.split(q, 1, dim=1)
        normed = [norm(piece) for norm, piece in zip(self.norms, pieces)]
        if self.how == "paired":
            normed = [normed[0] - normed[1], *normed[2:]]
        out = torch.cat(normed, dim=1)
        return out.transpose(1, 2).flatten(-2)[..., :8]


def test_heads_cut_one_by_one_and_put_back_in_order_pass():
    block = _PerHeadNorms("per_head")
    watch_first_forward(block, ["q_proj"], "model.layers.0")
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(block(x), _PerHeadNorms.forward(block, x))
    assert not block._forward_hooks and not block._forward_pre_hooks


def test_two_heads_pieces_combined_are_refused():
    block = _PerHeadNorms("paired")
    watch_first_forward(block, ["q_proj"], "model.layers.1")
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.q_proj is split column-wise by heads .* \(sub of two "):
        block(torch.randn(2, 5, 8))
