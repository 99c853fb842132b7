"""The planner counts the user's optimizer state: measured on fake tensors, checked against a real step.

Oracles: the state each optimizer documents (AdamW two moments, SGD one momentum buffer, AMSGrad a third
buffer) and the bytes of ``optimizer.state`` after one real step of the same model.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.modeling.optimizer_state import optimizer_states
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.planning.memory import model_state_bytes

OPTIMIZERS = {  # name: (factory, class name, state per parameter)
    "AdamW": (lambda params: torch.optim.AdamW(params, lr=1e-3), "AdamW", 2.0),
    "SGD": (lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9), "SGD", 1.0),
    "Adam-amsgrad": (lambda params: torch.optim.Adam(params, lr=1e-3, amsgrad=True), "Adam", 3.0),
    "SGD-no-momentum": (lambda params: torch.optim.SGD(params, lr=1e-2), "SGD", 0.0),
    # Held out of the planner's own tables: each documents its state (moments, sums, running averages).
    "NAdam": (lambda params: torch.optim.NAdam(params, lr=1e-3), "NAdam", 2.0),
    "RAdam": (lambda params: torch.optim.RAdam(params, lr=1e-3), "RAdam", 2.0),
    "Adagrad": (lambda params: torch.optim.Adagrad(params, lr=1e-2), "Adagrad", 1.0),
    "RMSprop-momentum": (lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9), "RMSprop", 2.0),
    "Adamax": (lambda params: torch.optim.Adamax(params, lr=1e-3), "Adamax", 2.0),
}


class _WithOptimizer(CausalLM):
    def __init__(self, make) -> None:
        super().__init__(LlamaConfig.from_name("tiny", n_layers=2), max_steps=10)
        self.make = make
        self.configure_model()

    def configure_optimizers(self):
        return {"optimizer": self.make(self.parameters())}


def _real_state_bytes(module: CausalLM) -> int:
    optimizer = module.configure_optimizers()["optimizer"]
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    module.log = lambda *args, **kwargs: None
    module.training_step(batch, 0).backward()
    optimizer.step()
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_planned_optimizer_state_equals_a_real_step(name):
    make, class_name, expected_states = OPTIMIZERS[name]
    measured = optimizer_states(_WithOptimizer(make))
    assert measured.states == pytest.approx(expected_states) and measured.names == (class_name,)
    module = _WithOptimizer(make)
    num_params = sum(p.numel() for p in module.parameters())
    _, _, planned = model_state_bytes(num_params, zero_stage=0, dp=1, optimizer_states=measured.states)
    assert planned == pytest.approx(_real_state_bytes(module), rel=0.15)


def test_a_model_on_meta_measures_without_allocating():
    with torch.device("meta"):
        module = CausalLM(LlamaConfig.from_name("7B", n_layers=2), max_steps=100)
        module.configure_model()
    assert optimizer_states(module).states == pytest.approx(2.0)  # CausalLM's AdamW, measured on fake tensors


def test_an_optimizer_that_cannot_step_on_fake_tensors_is_planned_as_adamw_and_said_so():
    states = optimizer_states(_WithOptimizer(lambda params: torch.optim.Adafactor(params, lr=1e-2)))
    assert states.states == 2.0 and states.names == ("Adafactor (planned as AdamW)",)


def test_configure_optimizers_that_needs_a_trainer_falls_back_to_adamw():
    module = CausalLM(LlamaConfig.from_name("tiny"))  # no max_steps: its schedule asks the Trainer
    module.configure_model()
    assert optimizer_states(module).states == 2.0
