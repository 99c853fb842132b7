"""Weights a ``configure_model`` loads survive the strategy's meta build (issue 33, item 4).

Lightning's ``ModelParallelStrategy`` builds eagerly, so a ``configure_model`` that loads known weights keeps them;
this strategy builds on the meta device and initializes each rank's shards, where a copy into a meta tensor does
nothing. The oracle is the known state itself: every parameter, gathered whole before the first step, must equal it,
under one process, ZeRO-3 on 2 ranks and tp2.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.models import CausalLM, Llama, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from tests.strategies._parity import data, full_state

pytestmark = pytest.mark.timeout(300)


def _known_state() -> dict[str, torch.Tensor]:
    """Values as a user would load them (from a file: real CPU tensors), even inside the strategy's meta build."""
    generator = torch.Generator().manual_seed(1234)  # not the run's seed: a fresh init cannot match by chance
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Llama(LlamaConfig.from_name("tiny")).state_dict().items()}
    return {k: torch.randn(shape, generator=generator, device="cpu") for k, shape in shapes.items()}


class LoadsInConfigureModel(CausalLM):
    """A user's module: builds the model in configure_model and loads known weights into it there."""

    def configure_model(self) -> None:
        if getattr(self, "model", None) is not None:
            return
        super().configure_model()
        self.model.load_state_dict(_known_state())


class StateAtFitStart(L.Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        self.state = full_state(pl_module)


def _state_before_training(layout: dict, devices: int) -> dict:
    torch.manual_seed(0)
    probe = StateAtFitStart()
    trainer = cpu_trainer(
        devices=devices,
        strategy=LLMParallelStrategy(**layout),
        max_steps=1,
        callbacks=[probe],
        limit_val_batches=0,
    )
    trainer.fit(LoadsInConfigureModel(LlamaConfig.from_name("tiny"), max_steps=1), data(4))
    return probe.state


def _two_ranks() -> dict:
    return {
        name: _state_before_training(layout, 2)
        for name, layout in {"zero3": {}, "tp2": {"tensor_parallel_size": 2}}.items()
    }


def _assert_known(state: dict, label: str) -> None:
    known = _known_state()
    for name, value in known.items():
        assert torch.equal(state[f"model.{name}"], value), f"{label}: {name} is not what configure_model loaded"


def test_weights_loaded_in_configure_model_are_kept_in_one_process():
    _assert_known(_state_before_training({}, 1), "one process")


@pytest.mark.distributed
def test_weights_loaded_in_configure_model_are_kept_under_zero3_and_tp2():
    results = run_distributed(_two_ranks, 2, timeout=280)
    for rank, states in enumerate(results):
        for label, state in states.items():
            _assert_known(state, f"{label} rank {rank}")
