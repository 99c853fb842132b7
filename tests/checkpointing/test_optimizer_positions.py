"""Position-keyed optimizer state read by parameter name, and what cannot be carried over refused by name.

Real optimizers' ``state_dict()`` in torch's numbering (one device, DDP) and in FSDP's (``model.parameters()``
places, groups sorted), on a model whose groups reorder its parameters, so the two readings differ.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llm.checkpointing.full_load import load_full, whole_model_parameters
from lightning_llm.checkpointing.optimizer_positions import named_optimizer_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # 0.weight (3, 4), 0.bias (3,), 1.weight (2, 3), ...


def _groups(model: nn.Module, weight_decay=(0.1, 0.0)) -> list[dict]:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() == 1]
    return [{"params": matrices, "weight_decay": weight_decay[0]}, {"params": vectors, "weight_decay": weight_decay[1]}]


def _names(model: nn.Module) -> list[list[str]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in _groups(model)]


def _stepped(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(_groups(model))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return optimizer


def _by_name(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    return {name: optimizer.state[p]["exp_avg"] for name, p in model.named_parameters()}


def test_torch_numbering_is_read_in_the_optimizers_group_order():
    model = _model()
    optimizer = _stepped(model)
    params = whole_model_parameters(model, optimizer, list(model.state_dict()))
    named = named_optimizer_state(optimizer.state_dict(), params, "ddp.ckpt")
    for name, exp_avg in _by_name(model, optimizer).items():
        torch.testing.assert_close(named.state[name]["exp_avg"], exp_avg, rtol=0, atol=0)
    assert named.hyperparameters["0.bias"]["weight_decay"] == 0.0
    assert named.hyperparameters["1.weight"]["weight_decay"] == 0.1


def test_fsdp_numbering_is_read_in_the_models_parameter_order():
    model = _model()
    optimizer = _stepped(model)
    place = {id(p): i for i, p in enumerate(model.parameters())}
    saved = optimizer.state_dict()
    live = [p for group in optimizer.param_groups for p in group["params"]]
    fsdp = {  # what FSDP.rekey_optim_state_dict(..., PARAM_ID, model) writes
        "state": {place[id(live[i])]: values for i, values in saved["state"].items()},
        "param_groups": [
            {**g, "params": sorted(place[id(p)] for p in live_g["params"])}
            for g, live_g in zip(saved["param_groups"], optimizer.param_groups)
        ],
    }
    params = whole_model_parameters(model, optimizer, list(model.state_dict()))
    named = named_optimizer_state(fsdp, params, "fsdp.ckpt")
    for name, exp_avg in _by_name(model, optimizer).items():
        torch.testing.assert_close(named.state[name]["exp_avg"], exp_avg, rtol=0, atol=0)


def test_positions_no_reading_explains_are_refused_naming_the_fix():
    model = _model()
    optimizer = _stepped(model)
    saved = optimizer.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(7, 7)  # no parameter has this shape
    params = whole_model_parameters(model, optimizer, list(model.state_dict()))
    with pytest.raises(
        ValueError, match=r"keyed by position .*shape.*\(7, 7\).*Build the optimizer's parameter groups"
    ):
        named_optimizer_state(saved, params, "odd.ckpt")


def test_state_of_a_reshaped_parameter_is_refused_naming_the_entry():
    model = _model()
    optimizer = _stepped(model)
    params = whole_model_parameters(model, optimizer, list(model.state_dict()))
    by_name = {
        "state": {"0.weight": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 3)}},
        "param_groups": [{"lr": 1e-3, "params": ["0.weight"]}],
    }
    with pytest.raises(ValueError, match=r"state\.0\.weight\.exp_avg in sharded\.ckpt has shape \(4, 3\).*\(3, 4\)"):
        named_optimizer_state(by_name, params, "sharded.ckpt")


def test_groups_the_checkpoint_split_differently_are_refused_naming_both_parameters():
    source = _model()
    optimizer = _stepped(source)
    saved, names = optimizer.state_dict(), [n for group in _names(source) for n in group]
    by_name = {  # ModelParallelStrategy's full files: keyed by name
        "state": {names[i]: values for i, values in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
    checkpoint = {"state_dict": source.state_dict(), "optimizer_states": [by_name]}
    model = _model()  # this run puts every parameter in one group
    with pytest.raises(ValueError, match=r"saved 0\.weight and 0\.bias with different .*weight_decay=0\.1 vs 0\.0"):
        load_full(model, [torch.optim.AdamW(model.parameters())], checkpoint, "two_groups.ckpt", strict=True)


def test_a_one_device_checkpoint_loads_whole_into_a_plain_model():
    source = _model()
    optimizer = _stepped(source)
    checkpoint = {"state_dict": source.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    model = _model()
    with torch.no_grad():
        model[0].weight.zero_()
    loaded = torch.optim.AdamW(_groups(model))
    load_full(model, [loaded], checkpoint, "one.ckpt", strict=True)
    torch.testing.assert_close(model.state_dict(), source.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(loaded.state_dict()["state"], optimizer.state_dict()["state"], rtol=0, atol=0)
