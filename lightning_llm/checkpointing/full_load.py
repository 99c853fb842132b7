"""Load a full checkpoint (every tensor whole, in one dict) into a model of any layout, with its optimizer state.

A full checkpoint is what Lightning writes as one file: on one device, under DDP, under ``FSDPStrategy`` with
``state_dict_type="full"``, under ``ModelParallelStrategy(save_distributed_checkpoint=False)``, this package's
``save_distributed_checkpoint=False`` and consolidated files, and a DeepSpeed checkpoint once consolidated
(:mod:`.deepspeed_read`). Every rank reads the whole dict (a file is memory-mapped) and keeps its own shards: the
model through torch's ``set_model_state_dict(full_state_dict=True)``, which places each tensor as this rank's
parameter is placed (DTensor shards under FSDP2 and tensor parallelism, a pipeline stage's own layers), and each
optimizer's state read in any of Lightning's layouts (:mod:`.optimizer_positions`) and loaded the same way, so a
one-device checkpoint resumes under ZeRO-3, tensor or pipeline parallelism and on one device alike. Before any
tensor is set, the checkpoint's names and shapes are compared with the model's both ways, and one saved untied for a
model that ties those weights is refused (:mod:`lightning_llm.modeling.tied`).

Example::

    checkpoint = load_torch("ddp.ckpt", mmap=True)
    load_full(model, [optimizer], checkpoint, source="ddp.ckpt", strict=True)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_llm._compat.lightning import unwrap_optimizer
from lightning_llm.checkpointing.dcp_load import model_shapes, on_any_rank
from lightning_llm.checkpointing.fs import Location
from lightning_llm.checkpointing.keys import matching_keys
from lightning_llm.checkpointing.optimizer_layout import hashable
from lightning_llm.checkpointing.optimizer_positions import NamedState, SavedParameters, named_optimizer_state
from lightning_llm.checkpointing.untrusted import load_torch
from lightning_llm.modeling.tied import differing, merged, refuse_untied, tied_groups

FULL = StateDictOptions(full_state_dict=True, strict=False)


def read_full_file(path: Location, weights_only: bool | None = None) -> dict[str, Any]:
    """A full checkpoint file (memory-mapped on a local disk), read weights-only unless ``weights_only=False``;
    ``ValueError`` naming the file when it holds other objects or is not a Lightning checkpoint."""
    loaded = load_torch(path, mmap=True, weights_only=weights_only)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state_dict"), dict):
        raise ValueError(
            f"{path} holds no 'state_dict' entry, so it is not a Lightning checkpoint; pass a checkpoint saved by "
            "trainer.save_checkpoint, ModelCheckpoint or CheckpointRotation."
        )
    return loaded


def load_full(model: nn.Module, optimizers: list, checkpoint: dict[str, Any], source: str, strict: bool) -> None:
    """Load ``checkpoint["state_dict"]`` into ``model`` and (``optimizers`` non-empty, i.e. fitting) each
    optimizer's state from ``checkpoint["optimizer_states"]``; strict both ways unless ``strict=False``.

    Arguments:
        model: the strategy's model, parallelized or not.
        optimizers: the run's optimizers, in ``configure_optimizers`` order (empty: the model only).
        checkpoint: Lightning's checkpoint dict, every tensor whole.
        source: the checkpoint's name for messages.
        strict: ``LightningModule.strict_loading``.
    """
    state = checkpoint["state_dict"]
    shapes = {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in state.items()}
    keep = matching_keys(model_shapes(model), shapes, strict, source)
    local = get_model_state_dict(model)
    # A tied group is one tensor here: the checkpoint's values under its names must be equal (a rank whose shard is
    # empty finds no group itself, so every rank's are joined and every rank refuses alike).
    refuse_untied(differing(merged(on_any_rank([tied_groups(local)])), state), source)
    set_model_state_dict(model, {k: state[k] for k in local if k in keep}, options=FULL)
    if not optimizers:
        return
    saved = checkpoint.get("optimizer_states")
    if not saved:
        raise KeyError(
            f"Trying to restore optimizer state but checkpoint {source} contains only the model. This is probably due "
            "to `ModelCheckpoint.save_weights_only` being set to `True`; fit from a checkpoint with optimizer state, "
            "or load the weights into the model before fitting."
        )
    if len(saved) != len(optimizers):
        raise ValueError(
            f"Checkpoint {source} holds the state of {len(saved)} optimizer(s), this run configures "
            f"{len(optimizers)}; resume with the configure_optimizers that saved it."
        )
    for optimizer, optimizer_state in zip(optimizers, saved):
        optimizer = unwrap_optimizer(optimizer)
        named = named_optimizer_state(optimizer_state, whole_model_parameters(model, optimizer, list(state)), source)
        regrouped = _as_this_optimizer_groups(model, optimizer, named, keep, source)
        set_optimizer_state_dict(model, optimizer, regrouped, options=FULL)


def whole_model_parameters(model: nn.Module, optimizer, saved_names: list[str]) -> SavedParameters:
    """The optimizer's groups and the parameters' global shapes on every rank together, stage after stage.

    ``saved_names`` (the checkpoint's ``state_dict`` keys) give the saving model's parameter order.
    """
    # A tied parameter goes by its first name, the one torch's state-dict functions key it by (under a later name
    # its state would match no parameter there, and be left a plain tensor beside a sharded parameter).
    name_of = {id(p): name for name, p in model.named_parameters()}
    groups = [[name_of[id(p)] for p in group["params"] if id(p) in name_of] for group in optimizer.param_groups]
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a DTensor's shape is global
    parts: list[Any] = [(groups, shapes)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (groups, shapes))  # global rank order: the pipeline axis is outermost
    merged: list[list[str]] = [[] for _ in groups]
    all_shapes: dict[str, tuple[int, ...]] = {}
    for part_groups, part_shapes in parts:
        for index, names in enumerate(part_groups):
            merged[index] += [name for name in names if name not in all_shapes and name not in merged[index]]
        all_shapes.update(part_shapes)
    order = [name for name in saved_names if name in all_shapes]
    return SavedParameters(groups=merged, model_order=order, shapes=all_shapes)


def _as_this_optimizer_groups(model: nn.Module, optimizer, named: NamedState, keep: set[str], source: str) -> dict:
    """torch's name-keyed form of this rank's part, grouped as ``optimizer`` groups its parameters.

    Each group takes the saved hyperparameters of its parameters (they must agree within the group: otherwise the
    checkpoint grouped them differently, refused naming both); a parameter the checkpoint holds no state for (none had
    a gradient yet when it was saved, as in torch's own ``Optimizer.state_dict``, or ``strict_loading=False`` left it
    out) keeps its fresh state, gathered whole.
    """
    live = get_optimizer_state_dict(model, optimizer)  # name-keyed, this rank's shards
    state: dict[str, Any] = {}
    groups = []
    for live_group in live["param_groups"]:
        names = list(live_group["params"])
        saved = [name for name in names if name in keep and name in named.hyperparameters]
        hyper = named.hyperparameters[saved[0]] if saved else {k: v for k, v in live_group.items() if k != "params"}
        for name in saved[1:]:
            if hashable(named.hyperparameters[name]) != hashable(hyper):
                raise ValueError(
                    f"Checkpoint {source} saved {saved[0]} and {name} with different optimizer hyperparameters "
                    f"({_difference(hyper, named.hyperparameters[name])}), but this run's optimizer puts them in one "
                    "parameter group. Build the optimizer's groups as the run that saved it did, or resume from the "
                    "weights alone (load checkpoint['state_dict'] into the model and fit without ckpt_path)."
                )
        groups.append({**hyper, "params": names})
        for name in names:  # the same names in the same order on every rank of a stage: full_tensor's gathers agree
            if name in keep and name in named.state:
                state[name] = named.state[name]
            elif name in live["state"]:
                state[name] = {k: _whole(v) for k, v in live["state"][name].items()}
    return {"state": state, "param_groups": groups}


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _difference(first: dict[str, Any], second: dict[str, Any]) -> str:
    keys = sorted(k for k in {*first, *second} if first.get(k) != second.get(k))
    return ", ".join(f"{k}={first.get(k)!r} vs {second.get(k)!r}" for k in keys[:3])
