"""A model's shape for FLOP accounting, read once from the whole (unsharded, possibly meta) model.

Model FLOPs per token follow the PaLM / Chinchilla accounting torchtitan uses:
``6 * N + 12 * L * H * d_head * T`` for forward plus backward, with N the parameters doing
matmuls (input embedding tables excluded, a tied output head included, a mixture of experts' active ones only), L attention blocks, H * d_head the
attention width and T the sequence length (summed per block: a hybrid's Mamba blocks add no ``T`` term). Hardware FLOPs add what activation checkpointing
recomputes. :func:`~lightning_llm.modeling.shape.counted_flops_per_token` is the independent check: torch's FLOP counter on a
fake-tensor forward (nothing allocated).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_llm.modeling.blocks import BlocksOverride, FoundBlocks, found_blocks
from lightning_llm.modeling.experts import inactive_expert_parameters
from lightning_llm.modeling.fake import fake_parameters


def _tied_to_linear(module: nn.Module, embedding: nn.Embedding) -> bool:
    return any(isinstance(m, nn.Linear) and m.weight is embedding.weight for m in module.modules())


def matmul_parameters(module: nn.Module) -> int:
    """Parameters a token's matmuls use: all but input embedding tables (a tied output head counts) and, in a
    mixture of experts, the routed experts it is not sent to (only ``top_k`` of ``num_experts`` are active)."""
    total = sum(p.numel() for p in module.parameters()) - inactive_expert_parameters(module)
    for m in module.modules():
        if isinstance(m, nn.Embedding) and not _tied_to_linear(module, m):
            total -= m.weight.numel()
    return total


_QUERY = re.compile(r"(^|\.)(q|wq|q_proj|query|to_q)$")


def attention_widths(module: nn.Module, blocks: Sequence[nn.Module]) -> list[int]:
    """H * d_head of each block: its query projection's width, 0 for a block without one.

    A hybrid model's Mamba, convolution or linear-attention blocks have no query projection and no
    cost quadratic in the sequence (their matmuls count in ``6 N``). Where no block has a query
    projection (a fused QKV such as GPT-2's ``c_attn``), every block takes the embedding width.
    """
    widths = [_query_width(block) for block in blocks]
    if any(widths):
        return widths
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError("Cannot find the attention width: no query projection and no embedding; pass flops_per_token.")
    return [embeddings[0].embedding_dim] * len(widths)


def _query_width(block: nn.Module) -> int:
    for name, m in block.named_modules():
        if isinstance(m, nn.Linear) and _QUERY.search(name):
            return m.out_features
    return 0


@dataclass
class ModelShape:
    """What FLOP accounting needs to know of a model, taken once from the whole (unsharded) model.

    Per block, so hybrid models (attention blocks beside Mamba or linear-attention blocks, dense beside
    MoE blocks) count each block as it is.
    """

    matmul_parameters: int
    block_matmul_parameters: list[int]
    block_attention_widths: list[int]

    @classmethod
    def of(cls, module: nn.Module, blocks: FoundBlocks | BlocksOverride = None) -> ModelShape:
        """Read from ``module`` (parameters may be DTensors or on the meta device)."""
        _, block_list = found_blocks(module, blocks)
        return cls(
            matmul_parameters=matmul_parameters(module),
            block_matmul_parameters=[
                sum(p.numel() for p in b.parameters() if p.dim() >= 2) - inactive_expert_parameters(b)
                for b in block_list
            ],
            block_attention_widths=attention_widths(module, list(block_list)),
        )

    @property
    def attention_width(self) -> int:
        """The widest block's H * d_head (every attention block's, in a model of one block class)."""
        return max(self.block_attention_widths)

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs (forward + backward) per trained token: ``6 N + 12 T sum(H d_head over attention blocks)``.

        Example::

            ModelShape.of(lightning_module).flops_per_token(seq_len=4096)
        """
        return 6 * self.matmul_parameters + 12 * sum(self.block_attention_widths) * seq_len

    def recompute_flops_per_token(self, seq_len: int, policies: list[str]) -> int:
        """FLOPs per token activation checkpointing adds: each fully checkpointed block's forward again.

        ``policies`` per block: "none", "full" or "op" (selective by operator keeps matmul outputs; the
        pointwise ops it recomputes are not counted in model FLOPs either).
        """
        forward = [
            2 * n + 4 * seq_len * width for n, width in zip(self.block_matmul_parameters, self.block_attention_widths)
        ]
        return sum(flops for flops, policy in zip(forward, policies) if policy == "full")


def counted_flops_per_token(module: nn.Module, step: Callable[[], torch.Tensor], tokens: int) -> float:
    """Forward FLOPs of ``step()`` counted by torch's FLOP counter on fake tensors, times 3 (backward = 2x), per token."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The math attention backend is plain matmuls the counter sees; fused CPU kernels count as zero.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fake_parameters(module, step)
    return 3 * counter.get_total_flops() / tokens
