"""Activation checkpointing through LLMParallelStrategy composes with ZeRO-3, TP/SP and pipeline stages:
each mode gives the losses and parameters of the same layout without checkpointing (fp32, 1e-6)."""

import pytest

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, train_layouts

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

AC = {
    "full": {"activation_checkpointing": "full"},
    "selective-op-every-other-mm": {
        "activation_checkpointing": "selective",
        "activation_checkpointing_options": {"selective": "op", "recompute_every_other_matmul": True},
    },
    "selective-layer": {
        "activation_checkpointing": "selective",
        "activation_checkpointing_options": {"selective": "layer"},
    },
    "auto": {"activation_checkpointing": "auto", "activation_checkpointing_options": {"budget": 1_500_000}},
}
LAYOUTS = {
    "dp2-zero3": {"zero_stage": 3},
    "tp2-sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_parallel_size": 2, "num_microbatches": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpointing_modes_match_the_layout_without_checkpointing(layout):
    base = LAYOUTS[layout]
    runs = [base] + [{**base, **ac} for ac in AC.values()]
    results = run_distributed(train_layouts, 2, "reference", runs, 2, layers=4, timeout=540)[0]
    for label, result in zip(AC, results[1:]):
        assert_parity(result, results[0], f"{layout} + {label}", rtol=1e-6)
