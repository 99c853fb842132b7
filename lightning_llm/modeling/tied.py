"""Which parameters of a model are one tensor under several names (tied weights)."""

from __future__ import annotations

from torch import nn


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
