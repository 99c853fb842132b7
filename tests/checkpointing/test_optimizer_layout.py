"""Name-keyed optimizer state rewritten in torch's layout equals what ``Optimizer.state_dict()`` gives.

Oracle: torch's own ``optimizer.state_dict()`` of the same optimizer, and ``load_state_dict`` of the converted
state into a fresh optimizer continuing exactly as the original.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from lightning_llm.checkpointing.optimizer_layout import from_named_groups, lightning_layout, to_torch_layout


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))


def _grouped_adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])


def _steps(model, optimizer, n: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        optimizer.zero_grad()
        model(torch.randn(3, 4, generator=generator)).square().mean().backward()
        optimizer.step()


def _equal(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("make", [_grouped_adamw, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)])
def test_flat_name_keyed_state_converts_to_torchs_own_state_dict(make):
    model = _model()
    optimizer = make(model)
    _steps(model, optimizer, 2)
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert any(key.startswith("param_groups.") for key in flat)
    _equal(to_torch_layout(flat, list(model.state_dict())), optimizer.state_dict())
    _equal(lightning_layout(flat, list(model.state_dict())), optimizer.state_dict())


def test_a_converted_state_resumes_a_fresh_optimizer_exactly():
    model, twin = _model(), _model()
    optimizer, fresh = _grouped_adamw(model), _grouped_adamw(twin)
    _steps(model, optimizer, 2)
    twin.load_state_dict(model.state_dict())
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    # A copy, as a file would be: torch's load_state_dict keeps the given tensors, which here are the live ones.
    fresh.load_state_dict(copy.deepcopy(to_torch_layout(flat, list(model.state_dict()))))
    _steps(model, optimizer, 3, seed=2)
    _steps(twin, fresh, 3, seed=2)
    _equal(twin.state_dict(), model.state_dict())


def test_lightning_model_parallel_layout_names_become_positions():
    model = _model()
    optimizer = _grouped_adamw(model)
    _steps(model, optimizer, 1)
    named = get_optimizer_state_dict(model, optimizer)  # Lightning's ModelParallelStrategy layout
    assert isinstance(named["param_groups"][0]["params"][0], str)
    _equal(from_named_groups(named), optimizer.state_dict())
    _equal(lightning_layout(optimizer.state_dict(), []), optimizer.state_dict())  # already torch's: unchanged


def test_state_for_another_model_is_refused():
    model = _model()
    optimizer = _grouped_adamw(model)
    _steps(model, optimizer, 1)
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    with pytest.raises(ValueError, match="names no parameter of the checkpoint's state_dict"):
        to_torch_layout(flat, ["other.weight"])
