"""Which parameters of a model are one tensor under several names (tied weights), and checkpoints that untie them.

Example::

    groups = tied_groups(module.state_dict())  # [["model.tok_embeddings.weight", "model.output.weight"]]
    refuse_untied(differing(groups, checkpoint["state_dict"]), "runs/step=10.ckpt")
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def tied_parameter_names(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. tied input and output embeddings).

    Example::

        tied_parameter_names(gpt2)   # [["transformer.wte.weight", "lm_head.weight"]]
    """
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def modules_shared_by_blocks(blocks: list[nn.Module], names: list[str]) -> list[tuple[nn.Module, list[str]]]:
    """The outermost modules that two or more ``blocks`` hold (one object called from several layers, as
    Zamba's shared attention or ALBERT's shared layer), each with its names in the blocks (``names[i]`` is block
    ``i``'s). Parameters shared some other way (one tensor in two blocks' distinct modules) raise ``ValueError``:
    no unit of work could own them once.

    Example::

        model.layers[1].attn = model.layers[0].attn
        modules_shared_by_blocks(list(model.layers), ["layers.0", "layers.1"])  # [(attn, ["layers.0.attn", "layers.1.attn"])]
    """
    where: dict[int, list[str]] = {}
    objects: dict[int, nn.Module] = {}
    for block, block_name in zip(blocks, names):
        for name, module in block.named_modules(remove_duplicate=False):
            if name:
                where.setdefault(id(module), []).append(f"{block_name}.{name}")
                objects[id(module)] = module
    shared = {key for key, places in where.items() if _blocks(places, names) > 1}
    inner = {id(sub) for key in shared for name, sub in objects[key].named_modules() if name}
    outermost = [(objects[key], where[key]) for key in shared if key not in inner]
    held = {id(p) for module, _ in outermost for p in module.parameters()}
    owners: dict[int, set[str]] = {}
    for block, block_name in zip(blocks, names):
        for _, param in block.named_parameters(remove_duplicate=False):
            if id(param) not in held:
                owners.setdefault(id(param), set()).add(block_name)
    crossing = [sorted(blocks_holding) for blocks_holding in owners.values() if len(blocks_holding) > 1]
    if crossing:
        raise ValueError(
            f"A parameter is one tensor held by the blocks {crossing[0]} in modules of their own; no block can own it "
            "once. Share the whole module between the blocks (one object called from each), or untie the weights."
        )
    return outermost


def _blocks(places: list[str], names: list[str]) -> int:
    """How many of the blocks ``names`` the module names ``places`` fall in."""
    return len({name for name in names for place in places if place.startswith(name + ".")})


# Tied weights on resume. A model that ties two names to one tensor (``tie_embeddings=True``: the input embedding and
# the output projection) still lists both in its state dict, so an untied checkpoint fits it by names and shapes;
# loading writes one tensor twice and keeps whichever came last, and training goes on from weights that are neither.
# So the checkpoint's tensors under a tied group's names must be equal; where they are not, it was saved untied and is
# refused. The other way (a tied checkpoint into an untied model) starts the two weights equal: what untying means.


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tied_groups(state: Mapping[str, object]) -> list[list[str]]:
    """Groups of state-dict names whose tensors are views of the same memory (tied weights), each in state order.

    A state dict holds detached views, not the parameters, so tensors are grouped by what they view (storage,
    offset, shape, strides); under sharding, by this rank's local shard (a rank with an empty shard sees none).
    """
    by_memory: dict[tuple, list[str]] = {}
    for name, value in state.items():
        if torch.is_tensor(value) and _local(value).numel():
            local = _local(value)
            key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride())
            by_memory.setdefault(key, []).append(name)
    return [names for names in by_memory.values() if len(names) > 1]


def differing(groups: Iterable[list[str]], state: Mapping[str, object]) -> list[tuple[str, str]]:
    """The pairs (first name, other name) of each tied group whose tensors in ``state`` differ (names ``state``
    lacks are skipped: a missing tensor is the key check's to report)."""
    pairs = []
    for group in groups:
        present = [name for name in group if torch.is_tensor(state.get(name))]
        first = present[0] if present else None
        pairs += [(first, name) for name in present[1:] if not torch.equal(_local(state[first]), _local(state[name]))]
    return pairs


def merged(groups_per_rank: Iterable[list[list[str]]]) -> list[list[str]]:
    """The tied groups every rank found, together (a rank whose shard is empty finds none of them)."""
    unique = {tuple(group) for groups in groups_per_rank for group in groups}
    return [list(group) for group in sorted(unique)]


def refuse_untied(pairs: list[tuple[str, str]], source: str) -> None:
    """Raise ``ValueError`` naming the checkpoint and the first pair the model ties but the checkpoint does not."""
    if pairs:
        first, other = pairs[0]
        raise ValueError(
            f"Checkpoint {source} holds different values for {first} and {other}, which this model ties (one "
            "tensor, e.g. tie_embeddings=True): it was saved from a model with untied weights, and loading it would "
            "keep one of the two silently. Resume with the model built as the run that saved it (untied: "
            "tie_embeddings=False), or load the weights yourself and tie them on purpose."
        )


def refuse_untied_names(groups: Iterable[list[str]], saved: Iterable[str], source: str) -> None:
    """Where a checkpoint lists each parameter once (DeepSpeed's names): two names of one tied group mean it was
    saved untied."""
    saved = set(saved)
    for group in groups:
        present = [name for name in group if name in saved]
        if len(present) > 1:
            raise ValueError(
                f"Checkpoint {source} holds {present[0]} and {present[1]} as separate parameters, which this model "
                "ties (one tensor, e.g. tie_embeddings=True): it was saved from a model with untied weights. Resume "
                "with the model built as the run that saved it (untied: tie_embeddings=False)."
            )
