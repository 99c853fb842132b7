"""The model's units as a layout sees them, and what a layout refuses of them before anything is changed.

The units are the blocks (each entered through itself, or through its slots where the stack's forward calls them one
by one: :func:`block_entries`), the modules several blocks share, and the data-parallel roots around the blocks
(:func:`data_parallel_roots`). The refusals name the layout that cannot hold the model and the one that can.
"""

from __future__ import annotations

from torch import nn

from lightning_llm.modeling.blocks import BlockSet, BlockStack, block_modules, block_names, entry_modules, loose_blocks
from lightning_llm.modeling.tied import modules_shared_by_blocks
from lightning_llm.parallel.mesh import ParallelDims


def data_parallel_roots(module: nn.Module, blocks_name: str, blocks: BlockStack | None = None) -> list[nn.Module]:
    """The modules to make FSDP/replicate roots: the top-level child holding the blocks, plus any other child with parameters.

    The LightningModule itself cannot be the root: Lightning calls ``training_step``, not
    ``forward``, so FSDP2's root forward hook (which gathers embeddings and head) would never run.
    Blocks without a container (:class:`BlockSet`): the top-level children with parameters that are not blocks.
    """
    if loose_blocks(blocks):
        units = {id(b) for b in blocks}
        return [c for _, c in module.named_children() if id(c) not in units and any(True for _ in c.parameters())]
    top = blocks_name.split(".")[0]
    roots = [module.get_submodule(top)] if top != blocks_name else []
    for name, child in module.named_children():
        if name != top and any(True for _ in child.parameters()):
            roots.append(child)
    if not roots:  # the blocks are a direct child of the LightningModule
        roots = [module]
    return roots


def shared_between_blocks(blocks_name: str, blocks, dims: ParallelDims) -> list[nn.Module]:
    """The modules several blocks call (sharded once, as units of their own); refused where a layout splits blocks.

    Tensor parallelism splits a shared module once (its heads too: :func:`.tp.apply.apply_tensor_parallel`);
    pipeline parallelism puts blocks on different ranks, where a module called from several blocks would be needed
    on two stages.
    """
    shared = modules_shared_by_blocks(block_modules(blocks), block_names(blocks_name, blocks))
    if shared and dims.pp > 1:
        module, places = shared[0]
        raise ValueError(
            f"{places[0]} ({type(module).__name__}) is one module called from {len(places)} blocks ({places}); "
            f"pipeline_parallel_size={dims.pp} puts blocks on different ranks, and the module would be needed on "
            "two stages. Train this model with tensor or data parallelism (ZeRO 0-3), which split or shard a "
            "shared module once."
        )
    if shared and (dims.dp * dims.cp > 1) and (loose_blocks(blocks) or "." not in blocks_name):
        raise ValueError(
            f"{shared[0][1][0]} is one module called from several blocks, and the blocks {blocks_name or 'found'} "
            "are direct children of the LightningModule: data parallelism needs one module holding the blocks "
            "(the model: embedding, blocks, head) to own the shared module's unit. Hold the model in one attribute "
            "of the LightningModule (self.model = ...)."
        )
    return [module for module, _ in shared]


def check_block_set(blocks: BlockSet, dims: ParallelDims, fp8: str | None) -> None:
    """Refuse what needs the blocks in one container (cut, split or hooked by position) before anything changes."""
    asked = [
        f"{what}={size}"
        for what, size in (
            ("tensor_parallel_size", dims.tp),
            ("pipeline_parallel_size", dims.pp),
            ("context_parallel_size", dims.cp),
        )
        if size > 1
    ] + ([f"fp8={fp8!r}"] if fp8 is not None else [])
    if asked:
        raise ValueError(
            f"{', '.join(asked)} needs the model's transformer blocks in one nn.ModuleList, nn.Sequential or nn.ModuleDict, but "
            f"the blocks here share no container ({blocks.names[:4]}). Hold the blocks in an nn.ModuleList and "
            "pass blocks='dotted.name' if the search misses it, or parallelize in configure_model by hand on "
            "self.device_mesh['tensor_parallel'] (the strategy then keeps that layout)."
        )


def block_entries(
    blocks_name: str, blocks: BlockStack, block_calls: dict[str, list[str]] | None, root: nn.Module
) -> dict[int, list[nn.Module]]:
    """Block (by id) -> the modules its computation is entered through (:func:`entry_modules`); ``block_calls``: what a
    traced forward called inside the blocks whose own forward it did not call (names in ``root``)."""
    calls = block_calls or {}
    return {
        id(block): entry_modules(block, [root.get_submodule(n) for n in calls[name]] if name in calls else None)
        for name, block in zip(block_names(blocks_name, blocks), block_modules(blocks))
    }


def refuse_pipeline_without_block_forward(
    blocks_name: str, blocks: BlockStack, entries: dict[int, list[nn.Module]]
) -> None:
    """Pipeline stages stand in for other stages' blocks when the model calls them; a block the model does not call
    (its slots called one by one, or its forward bypassed) cannot be stood in for."""
    for name, block in zip(block_names(blocks_name, blocks), block_modules(blocks)):
        if entries[id(block)] != [block]:
            raise ValueError(
                f"pipeline_parallel_size > 1 needs each block to be one module the model calls, but {name} "
                f"({type(block).__name__}) is entered through {len(entries[id(block)])} modules of its own (the model's "
                "forward calls its parts one by one, or calls another method than its forward), so a stage cannot "
                "stand in for the blocks of other stages. Use tensor parallelism or ZeRO (zero_stage=3) for this model."
            )


def refuse_ties_across_units(module: nn.Module, blocks: BlockSet) -> None:
    """Refuse a tensor held by two of the FSDP units (blocks and roots) of a model without a block container:
    each unit would shard it on its own. A container's ties (embedding and head) sit in one root instead."""
    roots = {id(r) for r in data_parallel_roots(module, "", blocks)}
    units = list(zip(blocks.names, blocks)) + [(n, c) for n, c in module.named_children() if id(c) in roots]
    inside_block = tuple(f"{name}." for name in blocks.names)  # a root holds what its blocks do not
    owners: dict[int, dict[str, str]] = {}
    for name, unit in units:
        for param_name, param in unit.named_parameters(remove_duplicate=False):
            full = f"{name}.{param_name}"
            if name not in blocks.names and full.startswith(inside_block):
                continue
            owners.setdefault(id(param), {}).setdefault(name, full)
    shared = [sorted(held.values()) for held in owners.values() if len(held) > 1]
    if shared:
        raise ValueError(
            f"Parameters {shared[0]} are one tensor held by two of the units {[n for n, _ in units][:6]}, which "
            "data parallelism shards separately. Pass blocks= listing units that keep each tied pair inside one "
            "unit (e.g. their common parent), or untie the weights."
        )
