"""LLMParallelStrategy trains exactly like a single process: every layout, three kinds of model.

Tolerance: fp32, per-step global losses within 1e-5 relative, final parameters within 1e-5
relative + 1e-6 absolute, after 10 steps with gradient clipping at 0.5 (so the global gradient
norm across shards must be right too).
"""

import pytest

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, train, train_layouts

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TWO_RANKS = {
    "dp2-zero0": {"zero_stage": 0},
    "dp2-zero1": {"zero_stage": 1},
    "dp2-zero2": {"zero_stage": 2},
    "dp2-zero3": {"zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "tp2-sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
}
FOUR_RANKS = {
    "dp2xtp2-zero3-sp": {"tensor_parallel_size": 2, "zero_stage": 3, "sequence_parallel": True},
    "hsdp2x2": {"data_parallel_replicate_size": 2, "zero_stage": 3},
}
ARCHS = ["reference", "hf_llama", "user"]

_reference_cache: dict = {}


def _single_process(arch):
    if arch not in _reference_cache:
        _reference_cache[arch] = train(arch)
    return _reference_cache[arch]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world_size, layouts", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2ranks", "4ranks"])
def test_layouts_match_single_process(arch, world_size, layouts):
    results = run_distributed(train_layouts, world_size, arch, list(layouts.values()), world_size, timeout=540)[0]
    reference = _single_process(arch)
    for label, result in zip(layouts, results):
        assert_parity(result, reference, f"{arch} {label}")
