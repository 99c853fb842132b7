"""8-rank 3D layouts (pipeline x data x tensor parallel) train exactly like a single process.

pp2 x dp2 x tp2 with 1F1B, and pp2 x tp2 x ZeRO-3 (dp2) with an interleaved schedule (2 stages per
rank, so 4 blocks). fp32; per-step losses and each parameter within 1e-5 relative error after 10 steps
with gradient clipping at 0.5 (the norm spans stages, tensor shards and data shards).

Eight gloo ranks need eight cores to finish in reasonable time: those tests run only when
``os.cpu_count() >= 8`` (the project's GPU machine has 16). That skip is a hardware condition, not a
missing feature; on a loaded 2-core machine both pass in about 7 minutes when forced with
``LIGHTNING_LLM_FORCE_8_RANKS=1``. Their 4-rank piece (pp2 x tp2, interleaved) runs everywhere.
"""

import os

import pytest

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, train, train_layouts

EIGHT_RANKS = {
    "pp2xdp2xtp2-zero2-1f1b": {
        "pipeline_parallel_size": 2,
        "tensor_parallel_size": 2,
        "zero_stage": 2,
        "num_microbatches": 4,
    },
    "pp2xtp2xzero3-interleaved1f1b-v2": {
        "pipeline_parallel_size": 2,
        "tensor_parallel_size": 2,
        "zero_stage": 3,
        "sequence_parallel": True,
        "pipeline_schedule": "Interleaved1F1B",
        "virtual_stages": 2,
        "num_microbatches": 4,
    },
}

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1800)]
needs_8_cores = pytest.mark.skipif(
    (os.cpu_count() or 1) < 8 and not os.environ.get("LIGHTNING_LLM_FORCE_8_RANKS"), reason="needs 8 cores"
)


ARCHS = ["reference", "hf_llama"]


def _both_archs(layout):
    return [train_layouts(arch, [layout], 8, layers=4) for arch in ARCHS]


@needs_8_cores
@pytest.mark.parametrize("label", EIGHT_RANKS)
def test_8_rank_3d_layouts_match_single_process(label):
    results = run_distributed(_both_archs, 8, EIGHT_RANKS[label], timeout=1700)[0]
    for arch, result in zip(ARCHS, results):
        assert_parity(result[0], train(arch, layers=4), f"{arch} {label}")


def _interleaved_tp(world_size):
    layout = {
        "pipeline_parallel_size": 2,
        "tensor_parallel_size": 2,
        "pipeline_schedule": "Interleaved1F1B",
        "virtual_stages": 2,
        "num_microbatches": 4,
    }
    return train_layouts("reference", [layout], world_size, layers=4)


def test_tensor_parallel_embedding_on_a_rank_with_a_later_stage():
    """pp2 x tp2, interleaved: rank 0 holds stages 0 and 2, so its TP embedding also runs while stage 2 is active.

    The 4-rank piece of the 3D layouts above, cheap enough for every CI run.
    """
    results = run_distributed(_interleaved_tp, 4, 4, timeout=600)[0]
    assert_parity(results[0], train("reference", layers=4), "pp2xtp2 interleaved1f1b-v2")
