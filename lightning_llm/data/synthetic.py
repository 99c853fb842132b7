"""The embedded default corpus: a seeded Markov chain whose entropy rate is known exactly.

Each context (the previous ``order`` tokens) has ``branching`` equally likely successors,
drawn once from the seed. Whatever the stationary distribution, every step then carries
exactly log(branching) nats, so a model's loss has a known floor: ``entropy_floor()``.
A freshly initialised model starts near log(vocab_size); a model that learned the chain
ends near the floor. No download, deterministic for a seed.
"""

from __future__ import annotations

import math

import numpy as np


def entropy_floor(branching: int) -> float:
    """The entropy rate in nats per token: the lowest achievable cross-entropy loss."""
    return math.log(branching)


def markov_corpus(
    num_tokens: int, vocab_size: int = 256, order: int = 1, branching: int = 4, seed: int = 0, stream: int = 0
) -> np.ndarray:
    """``num_tokens`` tokens of the chain defined by (vocab_size, order, branching, seed).

    ``stream`` selects an independent sample path of the same chain (train and validation
    use different streams of one chain).
    """
    if order < 1 or branching < 1 or branching > vocab_size:
        raise ValueError(f"Need order >= 1 and 1 <= branching <= vocab_size; got order={order}, branching={branching}.")
    table_rng = np.random.default_rng(seed)
    num_contexts = vocab_size**order
    successors = np.stack([table_rng.choice(vocab_size, size=branching, replace=False) for _ in range(num_contexts)])
    path_rng = np.random.default_rng([seed, stream + 1])
    choices = path_rng.integers(0, branching, size=num_tokens)
    start = path_rng.integers(0, vocab_size, size=order).tolist()
    # The chain is sequential by nature; plain Python ints walk it ~10x faster than numpy scalars.
    table, picks, tokens = successors.tolist(), choices.tolist(), start + [0] * (num_tokens - order)
    context = 0
    for t in start:
        context = (context * vocab_size + t) % num_contexts
    for i in range(order, num_tokens):
        token = table[context][picks[i]]
        tokens[i] = token
        context = (context * vocab_size + token) % num_contexts
    tokens = np.asarray(tokens)
    return tokens.astype(np.uint16 if vocab_size <= 65536 else np.uint32)
