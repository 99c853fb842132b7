"""``layout="auto"``'s candidates and ranking (:mod:`lightning_llm.strategies.layout_auto`)."""

from __future__ import annotations

import itertools

import torch

from lightning_llm.planning.step_time import Link, Rates
from lightning_llm.strategies.layout_auto import CHECKPOINTING, layouts, rank_candidates


def _model(seq_len: int = 64):
    from lightning_llm.models import CausalLM, LlamaConfig

    with torch.device("meta"):
        module = CausalLM(LlamaConfig.from_name("tiny", n_layers=4, max_seq_len=seq_len))
        module.configure_model()
    module.log = lambda *args, **kwargs: None
    return module


def test_candidates_are_exactly_the_valid_layouts_by_brute_force():
    # tiny: 4 heads, 2 kv heads, 4 blocks; 8 ranks, 64 tokens, 8 sequences per step
    got = {(lay.tp, lay.pp, lay.cp, lay.micro_batches, lay.sequence_parallel, lay.zero_stage, lay.activation_checkpointing, b)
           for lay, b in layouts(_model(), world_size=8, seq_len=64, global_batch=8)}  # fmt: skip
    want = set()
    for tp, pp, cp, m in itertools.product(range(1, 9), repeat=4):
        dp = 8 // (tp * pp * cp) if 8 % (tp * pp * cp) == 0 else 0
        if not dp or 2 % tp or pp > 4 or 64 % (2 * cp) or 8 % dp or (8 // dp) % m or m < pp:
            continue
        for sp in (False, True) if tp > 1 else (False,):
            for zero in (0, 2, 3) if dp * cp > 1 else (0,):
                want |= {(tp, pp, cp, m, sp, zero, ac, 8 // dp // m) for ac in CHECKPOINTING}
    assert got == want


def test_the_fastest_fitting_candidate_comes_first_and_memory_decides_fitting():
    rates = Rates(1e10, 1e10, 1e-5, Link(1e9, 1e-5))
    ranked = rank_candidates(_model(), world_size=2, seq_len=64, global_batch=4, device_memory=2**30, rates=rates)
    fitting = [c for c in ranked if c.fits]
    assert fitting and fitting == ranked[: len(fitting)]
    assert [c.time.total for c in fitting] == sorted(c.time.total for c in fitting)
    # with too little memory for the largest candidates they no longer fit
    tight = min(c.memory for c in ranked) * 1.2 / 0.9
    narrow = rank_candidates(_model(), world_size=2, seq_len=64, global_batch=4, device_memory=int(tight), rates=rates)
    assert 0 < sum(c.fits for c in narrow) < len(fitting)
    assert all(c.memory <= tight * 0.9 for c in narrow if c.fits)


def test_plan_layout_auto_prints_the_chosen_layout_and_the_runner_up(capsys):
    import re

    from lightning_llm.cli import main

    main(["plan", "--config", "configs/tiny.yaml", "--devices", "2", "--layout", "auto", "--rates", "H100"])
    out = capsys.readouterr().out
    chosen = re.search(
        r"^Chosen: tp=(\d+)(?: sp)? pp=(\d+) cp=(\d+) ep=1 dp=(\d+) zero=(\d) ac=(\w+) micro_batches=(\d+)", out, re.M
    )
    assert chosen, out
    tp, pp, cp, dp = (int(g) for g in chosen.groups()[:4])
    assert tp * pp * cp * dp == 2
    runner_up = re.search(r"^Runner-up: (tp=\d+(?: sp)? pp=\d+ cp=\d+)", out, re.M)
    assert runner_up and runner_up.group(1) != re.search(r"^Chosen: (tp=\d+(?: sp)? pp=\d+ cp=\d+)", out, re.M).group(1)


def test_plan_layout_auto_refuses_rates_of_an_unknown_device(capsys):
    import pytest

    from lightning_llm.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--config", "configs/tiny.yaml", "--devices", "2", "--layout", "auto", "--rates", "B300"])
    assert "No rates for device 'B300'" in capsys.readouterr().err


def test_a_tensor_parallel_layout_the_model_refuses_is_left_out(monkeypatch):
    from lightning_llm.strategies import layout_auto

    def refuse(module, *, tp, sequence_parallel, **kwargs):
        raise ValueError(f"tensor parallelism refuses tp={tp}")

    monkeypatch.setattr(layout_auto, "planned_shares", refuse)
    rates = Rates(1e10, 1e10, 1e-5, Link(1e9, 1e-5))
    ranked = rank_candidates(_model(), world_size=2, seq_len=64, global_batch=4, device_memory=2**30, rates=rates)
    assert ranked and {c.layout.tp for c in ranked} == {1}


def test_an_moe_models_candidates_search_the_expert_parallel_sizes_the_strategy_runs():
    from lightning_llm.models import CausalLM, LlamaConfig

    with torch.device("meta"):
        module = CausalLM(LlamaConfig.from_name("tiny-moe", n_layers=4, max_seq_len=64))  # 4 experts
        module.configure_model()
    got = {(lay.tp, lay.pp, lay.cp, lay.ep, lay.activation_checkpointing)
           for lay, _ in layouts(module, world_size=8, seq_len=64, global_batch=8)}  # fmt: skip
    want = set()
    for tp, pp, cp, ep in itertools.product((1, 2, 4, 8), repeat=4):
        dp = 8 // (tp * pp * cp) if 8 % (tp * pp * cp) == 0 else 0
        if not dp or 2 % tp or pp > 4 or dp % ep or 4 % ep or (ep > 1 and tp * cp > 1):
            continue
        want |= {(tp, pp, cp, ep, ac) for ac in CHECKPOINTING if ep == 1 or ac != "selective"}
    assert got == want
    assert {lay.ep for lay, _ in layouts(module, world_size=8, seq_len=64, global_batch=8, ep=2)} == {2}


def test_the_trainers_accumulation_runs_a_batch_per_micro_batch_or_a_schedule_per_batch():
    from lightning_llm.planning.step_time import StepTime
    from lightning_llm.strategies.layout_auto import Candidate

    found = list(layouts(_model(), world_size=2, seq_len=64, per_replica_batch=4, accumulate=3))
    assert {(lay.micro_batches, lay.pipeline_steps, size) for lay, size in found if lay.pp == 1} == {(3, 1, 4)}
    assert {(lay.micro_batches, lay.pipeline_steps, size) for lay, size in found if lay.pp == 2} == {
        (2, 3, 2),
        (4, 3, 1),
    }
    no_time = StepTime(*[0.0] * 7)
    # every candidate trains the dataloader's 4 sequences 3 times per data-parallel rank and step
    assert {Candidate(lay, size, 0, no_time, True).samples // lay.dp for lay, size in found} == {12}
