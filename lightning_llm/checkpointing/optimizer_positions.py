"""Any saved optimizer state keyed by parameter name: what lets one layout's checkpoint resume in another.

A Lightning checkpoint file holds each optimizer's state in one of three layouts, and does not say which:

- torch's ``Optimizer.state_dict()`` (one device, DDP, this package's full files): ``state`` keyed by each
  parameter's place in the optimizer's groups, group after group;
- Lightning's ``FSDPStrategy`` full files: keyed by the parameter's place in ``model.parameters()`` (FSDP's
  ``rekey_optim_state_dict``), each group listing its places sorted;
- name-keyed (Lightning's ``ModelParallelStrategy`` full files, DeepSpeed's once consolidated): ``state`` and each
  group's ``params`` by parameter name.

Positions are read both ways, the optimizer's groups first when the groups list consecutive places as torch numbers
them, and a reading is taken only where every saved tensor has its parameter's shape and every group its size; the
optimizer of the resuming run, built by the same ``configure_optimizers``, gives the group order (under pipeline
parallelism every stage's groups together, stage after stage). What no reading explains is refused naming the entry
and the fix, never loaded onto the wrong parameter. The result (:class:`NamedState`: state and hyperparameters per
parameter name, what this package's flattened ``state.<name>.<field>`` and ``param_groups.<name>.<key>`` hold) is
regrouped as the resuming optimizer groups its parameters (:mod:`.full_load`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

STATE, GROUPS = "state.", "param_groups."
WEIGHTS_ONLY_FIX = (
    "or resume from the weights alone: load checkpoint['state_dict'] into the model (model.load_state_dict, or "
    "LightningModule.load_from_checkpoint) and call fit without ckpt_path"
)


@dataclass
class SavedParameters:
    """The whole model's trainable parameters as the resuming run sees them, on every rank together.

    Arguments:
        groups: each optimizer group's parameter names, in the optimizer's order (under pipeline parallelism the
            stages' groups joined, stage after stage).
        model_order: the names in ``model.parameters()`` order of the model that saved the checkpoint (its
            ``state_dict`` keys that are parameters, tied duplicates once).
        shapes: each name's global (unsharded) shape.
    """

    groups: list[list[str]]
    model_order: list[str]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class NamedState:
    """One optimizer's saved state by parameter name: ``state[name][field]`` and ``hyperparameters[name][key]``."""

    state: dict[str, dict[str, Any]]
    hyperparameters: dict[str, dict[str, Any]]


def named_optimizer_state(saved: dict[str, Any], params: SavedParameters, source: str) -> NamedState:
    """``saved`` (any of the three layouts above, or this package's flattened one) keyed by parameter name.

    Example::

        named = named_optimizer_state(checkpoint["optimizer_states"][0], params, "ddp.ckpt")
        named.state["model.norm.weight"]["exp_avg"], named.hyperparameters["model.norm.weight"]["lr"]
    """
    if "param_groups" not in saved:
        return _from_flat(saved, params, source)
    state, groups = saved.get("state", {}), saved["param_groups"]
    keys = [p for group in groups for p in group["params"]]
    if all(isinstance(k, str) for k in [*keys, *state]):
        names = {k: k for k in keys}
    else:
        names = _read_positions(state, groups, params, source)
    _check_shapes(state, names, params.shapes, source)
    hyperparameters = {
        names[key]: {k: v for k, v in group.items() if k != "params"} for group in groups for key in group["params"]
    }
    return NamedState({names[key]: dict(values) for key, values in state.items()}, hyperparameters)


def _from_flat(flat: dict[str, Any], params: SavedParameters, source: str) -> NamedState:
    """This package's flattened layout: ``state.<name>.<field>``, ``param_groups.<name>.<hyperparameter>``."""
    by_length = sorted(params.shapes, key=len, reverse=True)
    named = NamedState({}, {})
    for key, value in flat.items():
        prefix, target = (STATE, named.state) if key.startswith(STATE) else (GROUPS, named.hyperparameters)
        rest = key[len(prefix) :]
        name = next((n for n in by_length if rest.startswith(n + ".") and "." not in rest[len(n) + 1 :]), None)
        if name is None:
            raise ValueError(f"Optimizer state entry {key} in {source} names no parameter of this model.")
        target.setdefault(name, {})[rest[len(name) + 1 :]] = value
    return named


def _read_positions(state: dict, groups: list[dict], params: SavedParameters, source: str) -> dict[int, str]:
    """Position -> name: the first reading that gives every entry its parameter's shape and every group its size."""
    positions = [p for group in groups for p in group["params"]]
    by_optimizer = _optimizer_reading(groups, params.groups)
    by_model = {p: params.model_order[p] for p in positions if 0 <= p < len(params.model_order)}
    by_model = by_model if len(by_model) == len(positions) else None
    torch_numbered = positions == list(range(len(positions)))
    readings = [by_optimizer, by_model] if torch_numbered else [by_model, by_optimizer]
    for reading in readings:
        if reading is not None and _first_misfit(state, reading, params.shapes) is None:
            return reading
    sizes = [len(g["params"]) for g in groups], [len(g) for g in params.groups]
    misfit = next((m for m in (_first_misfit(state, r, params.shapes) for r in readings if r) if m), "")
    raise ValueError(
        f"The optimizer state in {source} is keyed by position ({len(positions)} entries, groups of sizes "
        f"{sizes[0]}; this run's optimizer: {sizes[1]}), and neither the optimizer's group order nor the model's "
        f"parameter order gives every entry its parameter's shape{f' ({misfit})' if misfit else ''}. Build the "
        f"optimizer's parameter groups as the run that saved it did, {WEIGHTS_ONLY_FIX}."
    )


def _optimizer_reading(groups: list[dict], live: list[list[str]]) -> dict[int, str] | None:
    if [len(g["params"]) for g in groups] != [len(g) for g in live]:
        return None
    return {p: name for group, names in zip(groups, live) for p, name in zip(group["params"], names)}


def _first_misfit(state: dict, names: dict, shapes: dict[str, tuple[int, ...]]) -> str | None:
    for key, values in state.items():
        if key not in names:
            return f"entry {key} belongs to no parameter group"
        want = shapes.get(names[key])
        for name, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and want is not None and tuple(value.shape) != want:
                return f"entry {key}'s {name} is {tuple(value.shape)}, {names[key]} is {want}"
    return None


def _check_shapes(state: dict, names: dict, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Refuse state whose tensors do not have their parameter's shape (the layout changed it, or another model's)."""
    for key, values in state.items():
        name, want = names[key], shapes.get(names[key])
        if want is None:
            continue
        for field_name, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != want:
                raise ValueError(
                    f"Optimizer state {STATE}{name}.{field_name} in {source} has shape {tuple(value.shape)}, but the "
                    f"parameter {name} has {want}: it cannot be carried over to this model. Resume with the model "
                    f"and layout that saved it, {WEIGHTS_ONLY_FIX}."
                )
