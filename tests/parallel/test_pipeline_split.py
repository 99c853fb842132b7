"""Stage splits and stage placement against brute force and hand-written expectations."""

import itertools
import random

import pytest
import torch

from lightning_llm.parallel.pipeline.split import balanced_split, explicit_split, stage_to_rank


def _all_splits(n: int, stages: int):
    """Every way to cut n blocks into `stages` non-empty contiguous runs."""
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        yield [range(a, b) for a, b in itertools.pairwise(bounds)]


def _max_cost(split, costs, head, first=0):
    return max(
        sum(costs[i] for i in r) + (head if k == len(split) - 1 else 0) + (first if k == 0 else 0)
        for k, r in enumerate(split)
    )


@pytest.mark.parametrize("seed", range(40))
def test_balanced_split_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = [rng.randint(1, 20) for _ in range(n)]
    head = rng.choice([0, rng.randint(1, 40)])
    first = rng.choice([0, rng.randint(1, 40)])
    split = balanced_split(costs, stages, head_cost=head, first_cost=first)
    # A valid split: `stages` non-empty contiguous runs covering every block once, in order.
    assert len(split) == stages and all(len(r) > 0 for r in split)
    assert [i for r in split for i in r] == list(range(n))
    best = min(_max_cost(s, costs, head, first) for s in _all_splits(n, stages))
    assert _max_cost(split, costs, head, first) == best


def test_balanced_split_by_hand():
    # Costs 1..4, two stages: {1,2,3}|{4} has max 6, {1,2}|{3,4} has max 7, so the first.
    assert balanced_split([1, 2, 3, 4], 2) == [range(0, 3), range(3, 4)]
    # A head as expensive as 5 blocks pushes blocks off the last stage: {1,1,1}|{1}+5 -> max 6.
    assert balanced_split([1, 1, 1, 1], 2, head_cost=5) == [range(0, 3), range(3, 4)]
    # Embeddings as expensive as 5 blocks push blocks off the first stage: 5+{1}|{1,1,1} -> max 6.
    assert balanced_split([1, 1, 1, 1], 2, first_cost=5) == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError, match="3 pipeline stages need at least as many transformer blocks"):
        balanced_split([1, 1], 3)


def test_stage_to_rank_by_hand():
    assert stage_to_rank(4, 4, "1F1B") == [0, 1, 2, 3]
    assert stage_to_rank(8, 4, "Interleaved1F1B") == [0, 1, 2, 3, 0, 1, 2, 3]  # looped
    assert stage_to_rank(8, 4, "ZBVZeroBubble") == [0, 1, 2, 3, 3, 2, 1, 0]  # a V: each rank holds s and 2pp-1-s
    for pp in (1, 2, 3, 5):  # every rank holds the same number of stages either way
        for schedule in ("LoopedBFS", "ZBVZeroBubble"):
            ranks = stage_to_rank(2 * pp, pp, schedule)
            assert sorted(ranks) == sorted(list(range(pp)) * 2)


def test_explicit_split_names_blocks_by_pattern():
    split = [["model.layers.[0-2]"], ["model.layers.3", "model.layers.4"], ["model.layers.5"]]
    assert explicit_split(split, "model.layers", 6, 3) == [range(0, 3), range(3, 5), range(5, 6)]


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ([["m.0"], ["m.1"]], "has 2 stages but the schedule runs 3"),
        ([["m.0"], ["m.9"], ["m.1", "m.2"]], "names \\['m.9'\\], which match no block"),
        ([["m.0", "m.2"], ["m.1"], ["m.3"]], "is not a contiguous run of blocks: \\[0, 2\\]"),
        ([["m.1"], ["m.0"], ["m.2", "m.3"]], "must cover blocks 0..3 once, in order"),
        ([["m.0"], ["m.1"], ["m.2"]], "must cover blocks 0..3 once, in order; it covers \\[0, 1, 2\\]"),
    ],
)
def test_explicit_split_refuses_bad_splits(split, message):
    with pytest.raises(ValueError, match=message):
        explicit_split(split, "m", 4, 3)


def test_zbv_is_refused_by_name_on_torch_older_than_2_13(monkeypatch):
    # torch 2.11's ZBVZeroBubble fails in its first step's shape exchange between the two stages of one rank
    # (measured on gloo, .ci/image_versions); the refusal names the schedule and the version it needs.
    from torch.torch_version import TorchVersion

    from lightning_llm.strategies import LLMParallelStrategy

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0"))
    with pytest.raises(
        RuntimeError, match=r"pipeline_schedule='ZBVZeroBubble' needs torch >= 2.13; this is torch 2.11"
    ):
        LLMParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="ZBVZeroBubble")
    LLMParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="InterleavedZeroBubble")  # runs on 2.11
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.13.0"))
    LLMParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="ZBVZeroBubble")
