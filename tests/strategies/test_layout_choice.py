"""``LLMParallelStrategy(layout="auto")`` in a run: one layout for the job, applied, and training as one process does.

Two gloo ranks, the tiny Llama, 3 steps, fp32, H100 table rates (so the choice does not depend on this host's timing)
and once rates calibrated at setup (every rank measuring, rank 0 choosing); the tiny MoE with rates where launches
cost most and links nothing (so expert parallelism, which launches half the experts' ops per rank, is chosen).
Oracles: the single-process run of the same global batch (losses and every parameter within 1e-5 relative, as the
other parity tests), the ranks' own meshes, and the device memory given. Each data-parallel rank keeps the
dataloader's batch (4 sequences), so the global batch is 4 x the chosen data-parallel size.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, data, make_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

STEPS, PER_RANK = 3, 4


def _smallest_data_parallel_memory() -> float:
    """The least planned memory of a candidate with two data-parallel ranks: a budget just under it leaves only
    model-parallel layouts (tp, pp or cp over both ranks)."""
    from lightning_llm.planning.device_rates import device_rates
    from lightning_llm.strategies.layout_auto import rank_candidates

    module = make_model("reference")
    ranked = rank_candidates(
        module, world_size=2, seq_len=32, per_replica_batch=PER_RANK, device_memory=2**40, rates=device_rates("H100")
    )
    return min(c.memory for c in ranked if c.layout.dp == 2)


LAUNCH_BOUND = "launch-bound"  # rates of 1 ms per op, free links and compute


def _runs(runs: list) -> list:
    """Each (model, budget, rates) run on this rank: (losses, params, the chosen layout, the mesh's sizes and the
    expert-parallel size) or the error's text."""
    from unittest import mock

    from lightning_llm.planning.step_time import Link, Rates
    from lightning_llm.strategies import LLMParallelStrategy, layout_choice

    launch_bound = Rates(matmul_flops=1e15, memory_bandwidth=1e15, op_overhead=1e-3, link=Link(float("inf")))
    results = []
    for arch, budget, rates in runs:
        bound = rates == LAUNCH_BOUND
        strategy = LLMParallelStrategy(layout="auto", layout_rates="H100" if bound else rates, device_memory=budget)
        try:
            with mock.patch.object(layout_choice, "layout_rates", return_value=launch_bound) if bound else _same():
                losses, params = train(arch, strategy, devices=2, datamodule=data(PER_RANK), steps=STEPS)
        except ValueError as error:
            results.append(str(error))
            continue
        dims, chosen, ep = strategy.parallel_dims, strategy.run_state.layout, strategy.expert_parallel_size
        mesh = (dims.tp, dims.pp, dims.cp, dims.dp, strategy.zero_stage, strategy.pipeline.num_microbatches, ep)
        results.append((losses, params, chosen, mesh))
    return results


def _same():
    import contextlib

    return contextlib.nullcontext()


def test_layout_auto_applies_one_layout_per_job_and_trains_as_one_process():
    tight = int(_smallest_data_parallel_memory() / 0.9) - 1  # usable = 90%: no data-parallel candidate fits
    runs = [("reference", "80GB", "H100"), ("reference", tight, "H100"), ("reference", 10_000, "H100")]
    runs += [("reference", "80GB", "calibrate"), ("reference_moe", "80GB", LAUNCH_BOUND)]
    ranks = run_distributed(_runs, 2, runs, timeout=400)
    roomy, narrow, nothing, measured, experts = ranks[0]
    for index in (0, 1, 3, 4):  # both ranks applied rank 0's choice
        assert ranks[0][index][2:] == ranks[1][index][2:]
    trained = ((roomy, 80e9, "reference"), (narrow, tight, "reference"), (measured, 80e9, "reference"))
    for (losses, params, chosen, mesh), budget, arch in (*trained, (experts, 80e9, "reference_moe")):
        lay = chosen.layout
        assert mesh[:5] == (lay.tp, lay.pp, lay.cp, lay.dp, lay.zero_stage)
        assert mesh[5:] == (lay.micro_batches if lay.pp > 1 else None, lay.ep)
        assert chosen.fits and chosen.memory <= 0.9 * budget
        torch.manual_seed(0)
        reference = train(arch, datamodule=data(PER_RANK * lay.dp), steps=STEPS)
        assert_parity((losses, params), reference, f"layout='auto' chose {chosen.line()}")
    assert experts[2].layout.ep == 2  # launch-bound: each rank launches half the experts' ops
    assert roomy[2].layout.dp == 2  # with room, the least communication: data parallelism
    assert narrow[2].layout.dp == 1  # without it, a model-parallel layout that fits
    assert "found no layout of 2 ranks" in nothing and "0.0 GiB" in nothing and "Nothing fits" in nothing
    assert nothing == ranks[1][2]  # every rank refuses, before the first step


def test_layout_auto_refuses_a_layout_option_given_with_it():
    from lightning_llm.strategies import LLMParallelStrategy

    with pytest.raises(ValueError, match=r"layout='auto' chooses the layout, but tensor_parallel_size=2 was given"):
        LLMParallelStrategy(layout="auto", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="layout_rates"):
        LLMParallelStrategy(layout="auto", layout_rates="B300")
