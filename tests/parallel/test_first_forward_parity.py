"""The first forward of a split attention is checked against the same attention computed whole: a per-head value
the model derives from the head count it finds on the rank (ALiBi-like slopes from ``q.shape[1]``) trains wrong
under a split by heads, and is stopped before any optimizer step. The same attention with its slopes taken from
a stored head count trains (the plan divides the count, the slopes follow the heads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
DIM, HEADS, VOCAB = 16, 4, 32


class SlopedAttention(nn.Module):
    """Attention with a per-head additive bias on the scores, its slope computed from ``heads`` (a module attribute,
    which the strategy divides) plus ``rank_offset`` heads: all heads' slopes exist, each rank must take its own."""

    def __init__(self, local_count: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.local_count = HEADS, DIM // HEADS, local_count
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        heads = q.shape[1]
        # Wrong under a split: slopes 1..heads of the heads this rank finds, not of the heads it holds.
        slopes = torch.arange(1, heads + 1, dtype=x.dtype) / heads if self.local_count else None
        distance = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        bias = distance.tril().to(x.dtype)[None] * (slopes[:, None, None] if slopes is not None else 0.1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, local_count: bool) -> None:
        super().__init__()
        self.norm, self.self_attn = nn.LayerNorm(DIM), SlopedAttention(local_count)

    def forward(self, x):
        return x + self.self_attn(self.norm(x))


class TinyLM(__import__("lightning").LightningModule):
    def __init__(self, local_count: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.layers = nn.ModuleList(Block(local_count) for _ in range(2))

    def training_step(self, batch, batch_idx):
        x = self.embed(batch)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x)[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(local_count: bool) -> str | float:
    from lightning_llm.strategies import LLMParallelStrategy
    from lightning_llm.testing import cpu_trainer

    steps = []

    class Count(__import__("lightning").Callback):
        def on_before_optimizer_step(self, *args):
            steps.append(1)

    trainer = cpu_trainer(devices=2, strategy=LLMParallelStrategy(tensor_parallel_size=2), max_steps=2)
    trainer.callbacks.append(Count())
    data = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    try:
        trainer.fit(TinyLM(local_count), torch.utils.data.DataLoader(data, batch_size=4))
    except RuntimeError as error:
        return f"{error} (optimizer steps: {len(steps)})"
    return float(len(steps))


def _both():
    return {"local": _fit(True), "stored": _fit(False)}


def test_per_head_values_from_the_local_head_count_are_stopped_before_any_step():
    results = run_distributed(_both, 2, timeout=280)[0]
    assert isinstance(results["local"], str), "slopes from the local head count trained under tp2"
    assert "layers.0.self_attn, split by heads, computes something else than the same part whole" in results["local"]
    assert "tensor_parallel_replicate=['layers.*.self_attn']" in results["local"]
    assert results["local"].endswith("(optimizer steps: 0)")
    assert results["stored"] == 2.0  # the same attention, without a per-head value, trains
