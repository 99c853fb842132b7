"""LLMParallelStrategy's expert-parallel arguments: refused at construction when they cannot work, named in errors."""

from __future__ import annotations

import pytest

from lightning_llm.strategies import LLMParallelStrategy


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"expert_parallel_size": 0}, "expert_parallel_size"),
        (
            {"tensor_parallel_size": 2, "tensor_parallel_plan": {"*.experts": "expert_parallel"}},
            "the style 'expert_parallel', which only expert_parallel_size sets",
        ),
        (
            {"expert_parallel_size": 2, "context_parallel_size": 2},
            "expert_parallel_size=2 with context_parallel_size=2 is not supported yet",
        ),
        (
            {"expert_parallel_size": 4, "data_parallel_size": 6},
            "expert_parallel_size=4 does not divide data_parallel_size=6",
        ),
        ({"expert_parallel_plan": {"*.experts": "experts"}}, "unknown style"),
        (
            {"expert_parallel_size": 2, "activation_checkpointing": "selective"},
            "activation_checkpointing='selective' with expert_parallel_size=2 is not supported yet",
        ),
        ({"expert_parallel_plan": ["*.experts"]}, "must map module-name patterns to styles"),
    ],
)
def test_impossible_expert_parallel_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        LLMParallelStrategy(**kwargs)


@pytest.mark.timeout(30)
def test_expert_parallel_arguments_are_read_back():
    strategy = LLMParallelStrategy(expert_parallel_size=2, expert_parallel_plan={"*.moe.experts": "expert_parallel"})
    assert strategy.expert_parallel_size == 2
    assert strategy.expert_parallel_plan == {"*.moe.experts": "expert_parallel"}
    assert LLMParallelStrategy().expert_parallel_size == 1


@pytest.mark.timeout(30)
def test_expert_parallel_presets_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry.get("llm_ep2").expert_parallel_size == 2
    assert StrategyRegistry.get("llm_ep4").expert_parallel_size == 4
