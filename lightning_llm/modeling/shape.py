"""A model's shape for FLOP accounting, read once from the whole (unsharded, possibly meta) model.

Model FLOPs per token follow the PaLM / Chinchilla accounting torchtitan uses:
``6 * N + 12 * L * H * d_head * T`` for forward plus backward, with N the parameters doing
matmuls (input embedding tables excluded, a tied output head included), L blocks, H * d_head the
attention width and T the sequence length. Hardware FLOPs add what activation checkpointing
recomputes. :func:`counted_flops_per_token` is the independent check: torch's FLOP counter on a
fake-tensor forward (nothing allocated).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.fake import fake_parameters


def _tied_to_linear(module: nn.Module, embedding: nn.Embedding) -> bool:
    return any(isinstance(m, nn.Linear) and m.weight is embedding.weight for m in module.modules())


def matmul_parameters(module: nn.Module) -> int:
    """Parameters that take part in matmuls: all but input embedding tables (a tied output head counts)."""
    total = sum(p.numel() for p in module.parameters())
    for m in module.modules():
        if isinstance(m, nn.Embedding) and not _tied_to_linear(module, m):
            total -= m.weight.numel()
    return total


_QUERY = re.compile(r"(^|\.)(q|wq|q_proj|query|to_q)$")


def attention_width(module: nn.Module, blocks: nn.ModuleList) -> int:
    """H * d_head: the query projection's width, else the embedding width."""
    for name, m in blocks[0].named_modules():
        if isinstance(m, nn.Linear) and _QUERY.search(name):
            return m.out_features
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError("Cannot find the attention width: no query projection and no embedding; pass flops_per_token.")
    return embeddings[0].embedding_dim


@dataclass
class ModelShape:
    """What FLOP accounting needs to know of a model, taken once from the whole (unsharded) model."""

    matmul_parameters: int
    block_matmul_parameters: list[int]
    attention_width: int

    @classmethod
    def of(cls, module: nn.Module, blocks: str | None = None) -> ModelShape:
        """Read from ``module`` (parameters may be DTensors or on the meta device)."""
        _, block_list = find_blocks(module, blocks)
        return cls(
            matmul_parameters=matmul_parameters(module),
            block_matmul_parameters=[sum(p.numel() for p in b.parameters() if p.dim() >= 2) for b in block_list],
            attention_width=attention_width(module, block_list),
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs (forward + backward) per trained token: ``6 N + 12 L H d_head T``.

        Example::

            ModelShape.of(lightning_module).flops_per_token(seq_len=4096)
        """
        return 6 * self.matmul_parameters + 12 * len(self.block_matmul_parameters) * self.attention_width * seq_len

    def recompute_flops_per_token(self, seq_len: int, policies: list[str]) -> int:
        """FLOPs per token activation checkpointing adds: each fully checkpointed block's forward again.

        ``policies`` per block: "none", "full" or "op" (selective by operator keeps matmul outputs; the
        pointwise ops it recomputes are not counted in model FLOPs either).
        """
        forward = [2 * n + 4 * seq_len * self.attention_width for n in self.block_matmul_parameters]
        return sum(flops for flops, policy in zip(forward, policies) if policy == "full")


def counted_flops_per_token(module: nn.Module, step: Callable[[], torch.Tensor], tokens: int) -> float:
    """Forward FLOPs of ``step()`` counted by torch's FLOP counter on fake tensors, times 3 (backward = 2x), per token."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The math attention backend is plain matmuls the counter sees; fused CPU kernels count as zero.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fake_parameters(module, step)
    return 3 * counter.get_total_flops() / tokens
