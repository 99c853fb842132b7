"""Load any Lightning sharded checkpoint into any layout: this package's, ``ModelParallelStrategy``'s and
``FSDPStrategy``'s (``state_dict_type="sharded"``), verified and strict both ways.

All three are DCP directories with Lightning's other entries (loops, callbacks, schedulers) in ``meta.pt``, and all
three keep each optimizer's state as ``optimizer_<i>.state.<parameter name>.<field>``. They differ in two places:

- the model's tensors: ``state_dict.<name>`` (this package, ModelParallelStrategy) or ``model.<name>``
  (FSDPStrategy);
- the hyperparameters: per parameter, ``optimizer_0.param_groups.<name>.lr`` (this package: torch's flattened
  form, which pipeline stages need), or per group, ``optimizer_0.param_groups.0.lr`` with the group's names in
  ``optimizer_0.param_groups.0.params`` (both Lightning strategies, torch's and FSDP's unflattened forms).

DCP reshards by name, so the layout (tp, pp, ZeRO degree, world size) may differ between save and load. Optimizer
state whose saved shape is not its parameter's is refused naming the entry before DCP reads anything; so is, under
``strict``, an optimizer whose state the checkpoint lacks for some parameters (DCP would say only ``Missing key``),
and a checkpoint saved untied for a model that ties those weights (:mod:`lightning_llm.modeling.tied`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_llm._compat.lightning import METADATA_FILENAME, unwrap_optimizer
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.dcp import FLAT_OPTIMIZER, optimizer_state
from lightning_llm.checkpointing.fs import Location
from lightning_llm.checkpointing.keys import few, matching_keys
from lightning_llm.checkpointing.optimizer_positions import WEIGHTS_ONLY_FIX
from lightning_llm.checkpointing.untrusted import load_torch, refusals_unwrapped, safe_planner
from lightning_llm.modeling.tied import differing, refuse_untied, tied_groups

MODEL_KEYS = ("state_dict", "model")  # this package and ModelParallelStrategy; FSDPStrategy


def model_key(saved: dict[str, Any]) -> str:
    """Under which key a sharded checkpoint holds the model's tensors (``saved``: its metadata's entries)."""
    return next((key for key in MODEL_KEYS if any(name.startswith(key + ".") for name in saved)), MODEL_KEYS[0])


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """Name -> global shape of the model's state on every rank together (pipeline stages hold different parts)."""
    local = {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in get_model_state_dict(model).items()}
    if not dist.is_initialized():
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {name: shape for part in parts for name, shape in part.items()}


def on_any_rank(found: list) -> list:
    """What any rank found (every rank then raises alike); a rank whose shards are empty finds nothing itself."""
    if not dist.is_initialized():
        return found
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, found)
    return [item for part in parts for item in part]


def sharded_shapes(path: Location) -> dict[str, tuple[int, ...] | None]:
    """Name -> global shape of the model tensors in a sharded checkpoint, read from its ``.metadata``."""
    saved = cfs.storage_reader(path).read_metadata().state_dict_metadata
    prefix = model_key(saved) + "."
    return {
        key[len(prefix) :]: tuple(entry.size) if hasattr(entry, "size") else None
        for key, entry in saved.items()
        if key.startswith(prefix)
    }


def load(model: nn.Module, optimizers: list, path: Location, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` and ``optimizers`` (whatever layout saved it); returns the rest.

    ``optimizers`` is empty outside fitting (``trainer.test(ckpt_path=...)``), as Lightning restores optimizer state
    only to fit; a weights-only checkpoint given to fit is refused with Lightning's message.

    The names and global shapes of the model's tensors on every rank (all pipeline stages together) are
    compared with the checkpoint's both ways first (:func:`lightning_llm.checkpointing.keys.matching_keys`);
    with ``strict=False`` only the tensors both have with equal shapes are loaded, and their optimizer state.
    A checkpoint saved untied for a model that ties those weights is refused, on every rank alike.
    """
    if not cfs.isfile(cfs.join(path, ".metadata")):
        raise ValueError(
            f"The path {str(path)!r} does not point to a valid checkpoint: it is neither a checkpoint file nor a "
            "sharded checkpoint directory (no .metadata inside). "
            "Pass a checkpoint saved by LLMParallelStrategy, or load other weights into the model before fitting."
        )
    saved = cfs.storage_reader(path).read_metadata().state_dict_metadata
    key = model_key(saved)
    keep = matching_keys(model_shapes(model), sharded_shapes(path), strict, str(path))
    state = {k: v for k, v in get_model_state_dict(model).items() if k in keep}
    # Tied names read into tensors of their own, so the checkpoint's values can be compared before any is kept.
    groups = tied_groups(state)
    model_state = {key: {**state, **{n: torch.empty_like(state[n]) for g in groups for n in g[1:]}}}
    with refusals_unwrapped():
        dcp.load(model_state, storage_reader=cfs.storage_reader(path), planner=safe_planner(path))
    refuse_untied(on_any_rank(differing(groups, model_state[key])), str(path))
    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        _load_optimizer(model, unwrap_optimizer(optimizer), f"optimizer_{index}", path, saved, keep, strict)
    return load_torch(cfs.join(path, METADATA_FILENAME), weights_only=weights_only)


def _load_optimizer(
    model: nn.Module, optimizer, key: str, path: Location, saved: dict, keep: set[str], strict: bool
) -> None:
    """One optimizer's state: the entries the checkpoint holds for this rank's parameters. Under ``strict`` every
    parameter's state must be there (:func:`refuse_missing_optimizer_state`); otherwise the rest stay fresh."""
    if not any(name.startswith(key + ".") for name in saved):
        raise KeyError(
            f"Trying to restore optimizer state but checkpoint {path} contains only the model (no {key}). This "
            "is probably due to `ModelCheckpoint.save_weights_only` being set to `True`; fit from a checkpoint "
            "with optimizer state, or load the weights into the model before fitting."
        )
    live = optimizer_state(model, optimizer)  # flat: "state.<param>.<field>", "param_groups.<param>.<field>"
    grouped = f"{key}.param_groups.0.params" in saved
    if strict:  # per-group hyperparameters are not keyed by name: the state entries tell
        per_name = {k: v for k, v in live.items() if not (grouped and k.startswith("param_groups."))}
        refuse_missing_optimizer_state(path, key, per_name, saved)
    request = {
        f"{key}.{k}": v
        for k, v in live.items()
        if f"{key}.{k}" in saved and _parameter(k) in keep and not (grouped and k.startswith("param_groups."))
    }
    _check_state_shapes(request, saved, path)
    if grouped:  # per-group hyperparameters, read whole and spread over each group's names below
        request.update({name: None for name in saved if name.startswith(f"{key}.param_groups.")})
    with refusals_unwrapped():
        dcp.load(request, storage_reader=cfs.storage_reader(path), planner=safe_planner(path))
    loaded = {k[len(key) + 1 :]: v for k, v in request.items() if not k.startswith(f"{key}.param_groups.")}
    loaded.update(_per_parameter(request, key) if grouped else _flat_groups(request, key))
    set_optimizer_state_dict(model, optimizer, {**live, **loaded}, options=FLAT_OPTIMIZER)


def refuse_missing_optimizer_state(path: Location, key: str, request: dict[str, Any], saved) -> None:
    """Refuse a sharded checkpoint whose optimizer ``key`` holds no state for some of this optimizer's parameters
    (``request``: its flat entries; DCP would say only ``Missing key in checkpoint state_dict``), naming them and
    the way out."""
    missing = sorted({_parameter(name) for name in request if f"{key}.{name}" not in saved})
    if missing:
        raise ValueError(
            f"Checkpoint {path} holds no optimizer state for {few(missing)} of this model's parameters: the optimizer "
            "that saved it held other parameters (one tensor for tied weights, say, or another architecture). "
            "Resume with the model built as the run that saved it, or set `strict_loading = False` on the "
            "LightningModule to start those parameters' optimizer state afresh."
        )


def _parameter(flat_key: str) -> str:
    return flat_key.split(".", 1)[1].rsplit(".", 1)[0]


def _flat_groups(request: dict[str, Any], key: str) -> dict[str, Any]:
    prefix = f"{key}.param_groups."
    return {k[len(key) + 1 :]: v for k, v in request.items() if k.startswith(prefix)}


def _per_parameter(request: dict[str, Any], key: str) -> dict[str, Any]:
    """``{key}.param_groups.<g>.<hyperparameter>`` and ``.<g>.params`` as ``param_groups.<name>.<hyperparameter>``."""
    groups: dict[int, dict[str, Any]] = {}
    for name, value in request.items():
        found = re.fullmatch(rf"{re.escape(key)}\.param_groups\.(\d+)\.(\w+)", name)
        if found:
            groups.setdefault(int(found.group(1)), {})[found.group(2)] = value
    flat = {}
    for group in groups.values():
        for param in group.get("params", []):
            flat.update({f"param_groups.{param}.{k}": v for k, v in group.items() if k != "params"})
    return flat


def _check_state_shapes(request: dict[str, Any], saved: dict, path: Location) -> None:
    """Refuse state saved with another shape than its parameter's here (another model, or a layout that reshaped
    it) before DCP reads it, naming the entry."""
    for name, value in request.items():
        entry = saved[name]
        if not (torch.is_tensor(value) and value.dim() > 0 and isinstance(entry, TensorStorageMetadata)):
            continue
        if tuple(entry.size) != tuple(value.shape):
            raise ValueError(
                f"Optimizer state {name} in {path} has shape {tuple(entry.size)}, but this model's parameter has "
                f"{tuple(value.shape)}: it cannot be carried over. Resume with the model that saved it, "
                f"{WEIGHTS_ONLY_FIX}."
            )
