"""How much state the user's optimizer keeps per parameter, measured by one step on fake tensors.

The planner's byte tables assume AdamW (two moments per parameter). Users train with SGD, Adam with AMSGrad, Muon,
Lion or whatever their ``configure_optimizers`` returns, so the plan asks it: each optimizer it returns is rebuilt
per parameter shape on fake tensors (nothing is allocated, so a 70B model measures in a second), stepped once, and
its state tensors counted. An optimizer whose step cannot run on fake tensors (one that reads a value back to the
host, as Adafactor does) is planned as AdamW, which is said in the result.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from lightning_llm._compat.torch import FakeTensorMode

log = logging.getLogger(__name__)

ADAMW_STATES = 2.0  # exp_avg and exp_avg_sq: what the byte tables assume


@dataclass(frozen=True)
class OptimizerStates:
    """State elements per parameter element, over all of the module's trainable parameters.

    Attributes:
        states: 2.0 for AdamW, 1.0 for SGD with momentum or Muon, 0.0 for plain SGD, 3.0 for AMSGrad.
        names: the optimizer classes measured, and those planned as AdamW because they could not be measured.
    """

    states: float = ADAMW_STATES
    names: tuple[str, ...] = ()


def optimizer_states(module: nn.Module) -> OptimizerStates:
    """Measure the optimizers of ``module.configure_optimizers()`` (AdamW's 2 when it returns none or fails).

    Example::

        optimizer_states(CausalLM("7B"))  # OptimizerStates(states=2.0, names=('AdamW',))
    """
    try:
        optimizers = _optimizers(module.configure_optimizers())
    except Exception as error:  # a user's method may need a Trainer, data, ...: plan the tables' AdamW
        log.debug("configure_optimizers() could not run for planning (%s); planning AdamW's state", error)
        return OptimizerStates()
    states = elements = 0.0
    names = []
    for optimizer in optimizers:
        measured = True
        for group in optimizer.param_groups:
            shapes = Counter((tuple(p.shape), p.dtype) for p in group["params"] if p.requires_grad)
            for (shape, dtype), count in shapes.items():
                per_param = _states_of_one(type(optimizer), group, shape, dtype)
                if per_param is None:
                    per_param, measured = ADAMW_STATES * _numel(shape), False
                states += per_param * count
                elements += _numel(shape) * count
        names.append(type(optimizer).__name__ + ("" if measured else " (planned as AdamW)"))
    return OptimizerStates(states / elements if elements else ADAMW_STATES, tuple(names))


def _optimizers(config) -> list[torch.optim.Optimizer]:
    """The optimizers in any of the return forms Lightning's ``configure_optimizers`` accepts."""
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, dict):
        return _optimizers(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        return [opt for item in config for opt in _optimizers(item)]
    return []


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _states_of_one(cls, group: dict, shape: tuple[int, ...], dtype: torch.dtype) -> float | None:
    """State elements one parameter of ``shape`` gets after one step of ``cls`` with ``group``'s settings."""
    accepted = inspect.signature(cls.__init__).parameters
    settings = {k: v for k, v in group.items() if k != "params" and k in accepted}
    try:
        with FakeTensorMode():
            param = nn.Parameter(torch.empty(shape, dtype=dtype))
            param.grad = torch.empty(shape, dtype=dtype)
            optimizer = cls([param], **settings)
            optimizer.step()
            state = optimizer.state[param]
            return (
                float(sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0))
                / param.element_size()
            )
    except Exception as error:
        log.debug("%s could not step on fake tensors (%s)", cls.__name__, error)
        return None
