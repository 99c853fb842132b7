"""The default pipeline micro-batch count (one sample each) and the bubble warning.

Oracles: the bubble by hand ((p - 1) / (v m + p - 1)), and one process for the losses and parameters of a pp2
run that left ``num_microbatches`` unset.
"""

from __future__ import annotations

import warnings

import pytest

from lightning_llm.parallel.pipeline.microbatches import bubble_fraction, bubble_warning, default_microbatches
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, data, make_model, train

pytestmark = pytest.mark.timeout(300)
STEPS = 3


def test_default_is_one_sample_per_micro_batch_where_every_schedule_runs_it():
    assert default_microbatches(8, pp=2, stages_per_rank=1) == 8
    assert default_microbatches(8, pp=4, stages_per_rank=2) == 8  # 8 stages, 8 samples
    assert default_microbatches(6, pp=4, stages_per_rank=1) == 4  # 6 is no multiple of 4: one per stage
    assert default_microbatches(2, pp=2, stages_per_rank=2) == 4  # fewer samples than stages: one per stage
    assert default_microbatches(None, pp=4, stages_per_rank=1) == 4  # batch size unknown


def test_bubble_fraction_by_hand():
    assert bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 1, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 2, 4) == pytest.approx(3 / 11)  # interleaving divides the warm-up by v


def test_bubble_warning_names_the_count_that_brings_it_under_a_quarter():
    message = bubble_warning("1F1B", 4, 1, 4)
    assert "idle for 43%" in message and "num_microbatches=12" in message  # 3 / (12 + 3) = 20%
    assert bubble_fraction(4, 1, 12) <= 0.25 < bubble_fraction(4, 1, 8)
    assert bubble_warning("1F1B", 2, 1, 8) is None  # 11%
    assert bubble_warning("ZBVZeroBubble", 2, 2, 2) is None  # split backward fills the bubble
    assert bubble_warning("Interleaved1F1B", 4, 2, 8) is None  # 3 / 19 = 16%


def _pp2_defaults(world_size):
    results = []
    for per_rank_batch in (8, 2):
        strategy = LLMParallelStrategy(pipeline_parallel_size=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train("reference", strategy, devices=world_size, steps=STEPS, datamodule=data(per_rank_batch))
        bubble = [str(w.message) for w in caught if "leaves every rank idle" in str(w.message)]
        results.append((got, strategy.pipeline.num_microbatches, bubble))
    return results


@pytest.mark.distributed
def test_pp2_without_num_microbatches_uses_the_batch_and_warns_about_a_large_bubble():
    (eight, m8, warned8), (two, m2, warned2) = run_distributed(_pp2_defaults, 2, 2, timeout=280)[0]
    assert (m8, warned8) == (8, [])  # 8 micro-batches of one sample: a bubble of 1/9
    assert m2 == 2 and len(warned2) == 1 and "idle for 33%" in warned2[0]
    assert_parity(eight, train("reference", steps=STEPS, datamodule=data(8)), "pp2, default micro-batches, batch 8")
    assert_parity(two, train("reference", steps=STEPS, datamodule=data(2)), "pp2, default micro-batches, batch 2")


def _fit_pp3():
    from lightning_llm.testing import cpu_trainer

    strategy = LLMParallelStrategy(pipeline_parallel_size=3)
    model = make_model("reference", layers=2)
    try:
        cpu_trainer(devices=3, strategy=strategy, max_steps=1).fit(model, data(4))
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.distributed
def test_more_stages_than_blocks_is_refused_before_the_micro_batch_count():
    """pp=3 on 2 blocks with batch 4: the default micro-batch count (3) does not divide the batch either, but the
    root cause is the stages, said first."""
    error = run_distributed(_fit_pp3, 3, timeout=280)[0]
    assert "3 pipeline stages need at least as many transformer blocks, but the model has 2" in error, error


def test_a_micro_batch_count_left_unset_says_so():
    from types import SimpleNamespace

    from lightning_llm.strategies.pipeline_routing import check_microbatches

    trainer = SimpleNamespace(datamodule=SimpleNamespace(hparams={"batch_size": 4}))
    with pytest.raises(ValueError, match=r"num_microbatches=3 \(left unset, so one per pipeline stage\)"):
        check_microbatches(trainer, 3, 3, None)
    with pytest.raises(ValueError, match=r"num_microbatches=3, so it cannot"):
        check_microbatches(trainer, 3, 3, 3)
