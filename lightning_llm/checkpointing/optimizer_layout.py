"""Optimizer state in the layout plain PyTorch and Lightning's single-device and DDP strategies load.

The strategy saves each optimizer's state keyed by parameter name and flattened
(``"state.model.w1.weight.exp_avg"``, ``"param_groups.model.w1.weight.lr"``), as torch's
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` gives it: every rank then writes the same keys
whatever it holds, which pipeline stages with different parameter groups need. ``torch.optim.Optimizer.load_state_dict``
wants torch's own layout instead: ``state`` keyed by each parameter's position and ``param_groups`` listing those
positions. Converting needs the parameter names (a checkpoint's ``state_dict`` keys, to split a key into name and
field) and the groups, which the flat layout keeps only as each parameter's hyperparameters and the order its
entries were written in (group by group, as the optimizer holds them; under pipeline parallelism stage by stage):
parameters with equal hyperparameters form one group, groups and the parameters in each in the order they first
appear. An optimizer built from ``self.parameters()`` or from groups split by hyperparameters (weight decay on or
off, per-module learning rates) is rebuilt exactly; two groups with equal hyperparameters would be merged, and
torch then refuses the resume naming the group counts.
"""

from __future__ import annotations

from typing import Any

import torch

STATE, GROUPS = "state.", "param_groups."


def is_flat(optimizer_state: dict[str, Any]) -> bool:
    """Whether ``optimizer_state`` is in the flattened, name-keyed layout (not torch's ``state``/``param_groups``)."""
    return "param_groups" not in optimizer_state and any(k.startswith(GROUPS) for k in optimizer_state)


def to_torch_layout(flat: dict[str, Any], parameter_names: list[str]) -> dict[str, Any]:
    """Torch's ``Optimizer.state_dict()`` layout of a flattened, name-keyed optimizer state.

    Arguments:
        flat: ``{"state.<name>.<key>": value, "param_groups.<name>.<hyperparameter>": value}``.
        parameter_names: the model's parameter (and buffer) names, e.g. a checkpoint's ``state_dict`` keys; the
            names in ``flat`` are matched against them, longest first.

    Example::

        checkpoint["optimizer_states"] = [to_torch_layout(flat, list(checkpoint["state_dict"]))]
        torch.optim.AdamW(model.parameters()).load_state_dict(checkpoint["optimizer_states"][0])
    """
    by_length = sorted(parameter_names, key=len, reverse=True)
    hyper: dict[str, dict[str, Any]] = {}
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        prefix = GROUPS if key.startswith(GROUPS) else STATE if key.startswith(STATE) else None
        if prefix is None:
            raise ValueError(f"optimizer state key {key!r} is neither state.<name>.<key> nor param_groups.<name>.<key>")
        name, field = _split(key[len(prefix) :], by_length, key)
        (hyper if prefix == GROUPS else state).setdefault(name, {})[field] = value
    groups: dict[tuple, list[str]] = {}
    for name, values in hyper.items():
        groups.setdefault(hashable(values), []).append(name)
    positions: dict[str, int] = {}
    param_groups = []
    for names in groups.values():
        ids = list(range(len(positions), len(positions) + len(names)))
        positions.update(zip(names, ids))
        param_groups.append({**hyper[names[0]], "params": ids})
    unknown = sorted(set(state) - set(positions))
    if unknown:
        raise ValueError(
            f"optimizer state for {unknown[:3]} has no parameter group entry; the checkpoint is incomplete"
        )
    return {"state": {positions[name]: values for name, values in state.items()}, "param_groups": param_groups}


def from_named_groups(named: dict[str, Any]) -> dict[str, Any]:
    """Torch's layout of a name-keyed, unflattened optimizer state (``param_groups`` listing names, as Lightning's
    ``ModelParallelStrategy`` saves it): each name becomes its position across the groups, in order.

    Example::

        from_named_groups({"state": {"w": {"step": t}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]})
        # {"state": {0: {"step": t}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    """
    names = [name for group in named["param_groups"] for name in group["params"]]
    position = {name: index for index, name in enumerate(names)}
    groups, start = [], 0
    for group in named["param_groups"]:
        groups.append({**group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": {position[name]: values for name, values in named["state"].items()}, "param_groups": groups}


def lightning_layout(optimizer_state: dict[str, Any], parameter_names: list[str]) -> dict[str, Any]:
    """``optimizer_state`` in torch's layout, whichever of the three layouts it was saved in.

    Example::

        checkpoint["optimizer_states"] = [lightning_layout(s, list(checkpoint["state_dict"])) for s in saved]
    """
    if is_flat(optimizer_state):
        return to_torch_layout(optimizer_state, parameter_names)
    groups = optimizer_state.get("param_groups", [])
    if any(isinstance(p, str) for group in groups for p in group["params"]):
        return from_named_groups(optimizer_state)
    return optimizer_state


def _split(rest: str, names_longest_first: list[str], key: str) -> tuple[str, str]:
    for name in names_longest_first:
        if rest.startswith(name + ".") and "." not in rest[len(name) + 1 :]:
            return name, rest[len(name) + 1 :]
    raise ValueError(
        f"optimizer state key {key!r} names no parameter of the checkpoint's state_dict; it was saved for another model"
    )


def hashable(values: dict[str, Any]) -> tuple:
    """Hyperparameters as a hashable, comparable value (tensors by their elements, lists as tuples)."""

    def plain(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.flatten().tolist()))
        if isinstance(value, (list, tuple)):
            return tuple(plain(v) for v in value)
        return value

    return tuple(sorted((k, plain(v)) for k, v in values.items()))
