"""Modelled training FLOPs per token of each part of a model, for balancing pipeline stages.

A stage's time is roughly its FLOPs, not its parameter count: attention's score and value matmuls
grow with the sequence length and own no parameters, the output head's logits feed a softmax and
cross-entropy over the whole vocabulary, and an embedding lookup owns many parameters but does
almost no arithmetic. Forward plus backward, per token (the accounting of
:mod:`lightning_llm.modeling.shape`):

* a block: ``6 * (its matmul parameters) + 12 * (its attention width) * seq_len`` (width 0 for a hybrid's
  Mamba or linear-attention blocks, :func:`~lightning_llm.modeling.shape.attention_widths`);
* the first stage's extra (embeddings): ``2 * embedding_dim``, the lookup and its gradient's scatter;
* the last stage's extra (final norm, head, loss): ``6 * (matmul parameters after the blocks)`` plus
  ``LOSS_FLOPS_PER_LOGIT * vocab`` for the softmax cross-entropy and its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_llm.modeling.shape import attention_widths

# Softmax cross-entropy per logit: max, subtract, exp, sum and log forward; softmax minus one-hot backward.
LOSS_FLOPS_PER_LOGIT = 8


@dataclass
class StageCosts:
    """Modelled FLOPs per token: each block, what the first stage adds (embeddings), what the last adds (head, loss)."""

    blocks: list[int]
    first: int
    last: int


def _matmul_parameters(module: nn.Module) -> int:
    # Weights of two or more dimensions multiply activations; norms' and biases' vectors do not.
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def _vocab_size(after: list[nn.Module]) -> int:
    linears = [m for module in after for m in module.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else 0


def stage_costs(
    module: nn.Module, blocks: Sequence[nn.Module], before: list[str], after: list[str], seq_len: int | None
) -> StageCosts:
    """Modelled FLOPs per token of ``blocks`` and of the modules named in ``before`` and ``after`` the blocks.

    ``seq_len`` None: attention's sequence term is left out (blocks cost their matmul parameters only).

    Example::

        before, after = outer_modules(module, "model.layers")
        costs = stage_costs(module, module.model.layers, before, after, seq_len=4096)
        balanced_split(costs.blocks, 4, head_cost=costs.last, first_cost=costs.first)
    """
    try:  # per block: a hybrid's Mamba or linear-attention blocks have no sequence term
        widths = attention_widths(module, list(blocks)) if seq_len else [0] * len(blocks)
    except ValueError:  # neither a query projection nor an embedding to read the width from
        widths = [0] * len(blocks)
    block_costs = [6 * _matmul_parameters(b) + 12 * width * (seq_len or 0) for b, width in zip(blocks, widths)]
    embeddings = [module.get_submodule(n) for n in before]
    first = sum(2 * m.embedding_dim for m in embeddings if isinstance(m, nn.Embedding))
    tail = [module.get_submodule(n) for n in after]
    # outer_modules lists a module and its parameter-holding children apart; count each parameter once.
    params = {id(p): p for m in tail for p in m.parameters(recurse=False) if p.dim() >= 2}
    last = 6 * sum(p.numel() for p in params.values()) + LOSS_FLOPS_PER_LOGIT * _vocab_size(tail)
    return StageCosts(blocks=block_costs, first=first, last=last)
