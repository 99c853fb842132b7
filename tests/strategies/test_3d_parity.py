"""8-rank 3D layouts (pipeline x data x tensor parallel) train exactly like a single process.

pp2 x dp2 x tp2 with 1F1B, and pp2 x tp2 x ZeRO-3 (dp2) with an interleaved schedule (2 stages per
rank, so 4 blocks). fp32; per-step losses and each parameter within 1e-5 relative error after 10 steps
with gradient clipping at 0.5 (the norm spans stages, tensor shards and data shards).

Eight gloo ranks need eight cores to finish in reasonable time: the test runs only when
``os.cpu_count() >= 8`` (the project's GPU machine has 16). That skip is a hardware condition, not a
missing feature; on 2 cores the same test passes in about ten minutes when forced with
``LIGHTNING_LLM_FORCE_8_RANKS=1``.
"""

import os

import pytest

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, train, train_layouts

EIGHT_RANKS = {
    "pp2xdp2xtp2-1f1b": {
        "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 0, "num_microbatches": 4,
    },
    "pp2xtp2xzero3-interleaved1f1b-v2": {
        "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3, "sequence_parallel": True,
        "pipeline_schedule": "Interleaved1F1B", "virtual_stages": 2, "num_microbatches": 4,
    },
}

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        (os.cpu_count() or 1) < 8 and not os.environ.get("LIGHTNING_LLM_FORCE_8_RANKS"), reason="needs 8 cores"
    ),
]


@pytest.mark.parametrize("arch", ["reference", "hf_llama"])
def test_8_rank_3d_layouts_match_single_process(arch):
    results = run_distributed(train_layouts, 8, arch, list(EIGHT_RANKS.values()), 8, layers=4, timeout=1700)[0]
    reference = train(arch, layers=4)
    for label, result in zip(EIGHT_RANKS, results):
        assert_parity(result, reference, f"{arch} {label}")
