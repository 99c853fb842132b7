"""Model discovery: where the transformer blocks are.

The blocks are the container of layers that holds most of the model's parameters, whatever their
classes: hybrid models mix attention blocks with Mamba or linear-attention blocks (Jamba, Bamba,
Qwen3-Next), MoE models mix dense and sparse blocks (DeepSeek-V3's first layers). A mixture-of-experts
layer's own list of experts sits inside a block, so it always holds fewer parameters than the list of
blocks around it. Three containers are supported: ``nn.ModuleList`` (a forward loops over it), ``nn.Sequential``
(the forward calls it) and ``nn.ModuleDict`` (torchtitan and OLMo-core key their blocks "0", "1", ... and loop over
``values()``; its blocks come back as a :class:`BlockSet` that names the dict as its container). The strategy reads
the blocks off the model's forward first (:mod:`lightning_llm.modeling.structure`) and passes what it found here as
``override``; the search below is how a model is read where no forward can be run.

A block need not have a forward of its own: x-transformers keeps each layer as an ``nn.ModuleList`` of slots the
stack's forward calls one by one. :func:`entry_modules` gives the modules through which each block is entered, which
is what data parallelism, activation checkpointing and compile hook.

A model without such a container (a small MLP, Lightning's test models) is never refused: its units are the
children of its outermost module with more than one child holding parameters (:class:`BlockSet`), or that one
leaf module. ``blocks=`` may also list the blocks' names, or pick them with a callable. Data parallelism (ZeRO 0-3),
activation checkpointing and compile work on such a set; splitting layers across ranks (tensor, pipeline, context
parallelism, fp8 by block) needs a container and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from torch import nn

BlockStack = nn.ModuleList | nn.Sequential
"""The containers a model may hold its blocks in."""

BlocksOverride = str | Sequence[str] | Callable[[str, nn.Module], bool] | None
"""What ``blocks=`` takes: a container's dotted name, the blocks' dotted names, or ``(name, module) -> bool``."""


class FoundBlocks(NamedTuple):
    """What :func:`find_blocks` found: the container's dotted name and the blocks. Setup finds them once and hands
    this on; :func:`found_blocks` passes it through instead of searching again.

    Example::

        name, blocks = found = find_blocks(model)
        assert found_blocks(model, found) is found
    """

    name: str
    blocks: BlockStack


def found_blocks(module: nn.Module, blocks: FoundBlocks | BlocksOverride) -> FoundBlocks:
    """``blocks`` if it was found already, else :func:`find_blocks` with it as the override."""
    return blocks if isinstance(blocks, FoundBlocks) else find_blocks(module, blocks)


class BlockSet(nn.ModuleList):
    """Blocks that share no container: a list of the modules (not registered in the model) and their dotted names.

    Example::

        units = BlockSet(["model.w1", "model.w2"], [model.model.w1, model.model.w2])
        units.names   # ["model.w1", "model.w2"]
    """

    def __init__(self, names: list[str], modules: list[nn.Module], container: str | None = None) -> None:
        super().__init__(modules)
        self.names = list(names)
        self.container = container  # the dotted name of the nn.ModuleDict holding them, if one does


def loose_blocks(blocks: nn.Module) -> bool:
    """Whether ``blocks`` share no container (a :class:`BlockSet` of attributes or chosen modules)."""
    return isinstance(blocks, BlockSet) and blocks.container is None


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines a forward (``nn.ModuleList``/``nn.ModuleDict`` and plain ``nn.Module`` do not)."""
    return type(module).forward is not nn.Module.forward


def entry_modules(block: nn.Module, called: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules a block's computation is entered through, for the hooks data parallelism and checkpointing use.

    A block with a forward of its own is entered through itself. A list of slots (x-transformers: norms, mixer,
    residual; ``None`` slots skipped) through its outermost submodules with a forward, those holding parameters.
    ``called``: what a traced forward called inside the block, when the model bypasses the block's own forward
    (yet-another-retnet calls ``layer.forward_parallel``).

    Example::

        entry_modules(model.layers[0])           # [model.layers[0]]
        entry_modules(x_transformer.layers[0])   # [LayerNorm, Attention, Residual]
    """
    if has_own_forward(block) and called is None:
        return [block]
    found = called if called is not None else [m for child in block.children() for m in entry_modules(child)]
    found = list({id(m): m for m in found}.values())  # a module called twice (a dropout) is one entry
    with_parameters = [m for m in found if any(True for _ in m.parameters())]
    return with_parameters or found


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_blocks(module: nn.Module, override: BlocksOverride = None) -> FoundBlocks:
    """The dotted name and the container (``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``) of blocks in ``module``.

    Without ``override`` it is the container of layers holding the most parameters, then the most
    children, then the outermost (``model.layers`` in Llama and Jamba, ``transformer.h`` in GPT-2); its
    blocks may be of different classes. An ``nn.ModuleDict`` (torchtitan's layout) comes back as a
    :class:`BlockSet` of its entries in order, naming the dict as its container. A container with an ``nn.Embedding`` child holds a whole model,
    not its blocks, and ``module`` itself is never the blocks. ``override`` is a dotted submodule name
    (as in ``named_modules()``) for models where that guess is wrong; a list of dotted names or a callable
    ``(name, module) -> bool`` picks blocks that share no container. Blocks without a container (given so, or
    a model with no container at all) come back as a :class:`BlockSet` named ``""``.

    Arguments:
        module: the model, or the LightningModule holding it.
        override: see :data:`BlocksOverride`; ``None`` to search.

    Example::

        name, blocks = find_blocks(Llama(LlamaConfig.from_name("tiny")))   # ("layers", ModuleList(...))
        name, blocks = find_blocks(model, "decoder.stack")                 # a list the search would miss
        name, blocks = find_blocks(model, ["encoder", "decoder"])          # ("", BlockSet: two units)
        name, blocks = find_blocks(model, lambda n, m: isinstance(m, MyBlock))
    """
    if isinstance(override, str):
        return FoundBlocks(override, _named_stack(module, override))
    if override is not None:
        return FoundBlocks("", _chosen_set(module, override))
    candidates = [
        (name, m, name.count(".")) for name, m in module.named_modules() if name and _holds_layers(m) and len(m)
    ]
    if not candidates:
        return FoundBlocks("", default_units(module))
    name, blocks, _ = max(candidates, key=lambda c: (_numel(c[1]), -c[2], len(c[1])))
    return FoundBlocks(name, _dict_blocks(name, blocks) if isinstance(blocks, nn.ModuleDict) else blocks)


def _dict_blocks(name: str, blocks: nn.ModuleDict) -> BlockSet:
    """The entries of an ``nn.ModuleDict`` of blocks, in its order, as a :class:`BlockSet` naming the dict."""
    return BlockSet([f"{name}.{key}" for key in blocks], list(blocks.values()), container=name)


def default_units(module: nn.Module) -> BlockSet:
    """The units of a model without a block container: below the wrappers that hold one child with parameters
    (the LightningModule around ``self.model``), the children with parameters; a single leaf layer is its own unit.

    Example::

        default_units(boring_model).names    # ["layer"]
        default_units(template_model).names  # ["model.w1", "model.w2", "model.w3"]
    """
    direct = [name for name, _ in module.named_parameters(recurse=False)]
    if direct:  # the LightningModule cannot be an FSDP unit: Lightning calls training_step, not forward
        raise ValueError(
            f"{type(module).__name__} holds parameters {direct[:4]} itself and no block container, so there is no "
            "submodule to shard them with; hold them in a submodule (self.model = ...), or pass blocks= naming "
            "the container of blocks."
        )
    root, prefix = module, ""
    while True:
        held = [(n, c) for n, c in root.named_children() if _numel(c)]
        own = any(True for _ in root.parameters(recurse=False))
        if len(held) != 1 or own:
            break
        name, child = held[0]
        if not any(True for _ in child.children()):
            return BlockSet([prefix + name], [child])
        root, prefix = child, f"{prefix}{name}."
    return BlockSet([prefix + n for n, _ in held], [c for _, c in held])


def block_names(blocks_name: str, blocks: BlockStack) -> list[str]:
    """The dotted name of each block, in order (``model.layers.0``; a Sequential's own keys where it has them).

    Example::

        block_names("model.layers", model.model.layers)   # ["model.layers.0", "model.layers.1", ...]
    """
    if isinstance(blocks, BlockSet):
        return list(blocks.names)
    return [f"{blocks_name}.{key}" for key, _ in blocks.named_children()]


def block_modules(blocks: BlockStack) -> list[nn.Module]:
    """The blocks themselves, in order: read from the container's registry, so a pipeline stage's gated
    list (which yields stand-ins while a schedule runs) gives its real blocks and placeholders."""
    return [block for _, block in blocks.named_children()]


def block_kind(block: nn.Module) -> tuple[type, tuple[str, ...]]:
    """A block's class and parameter names. Hybrid stacks mix classes, and one class can hold different layers
    (DeepSeek-V3's dense and MoE blocks): blocks of one kind are planned and reported alike."""
    return type(block), tuple(n for n, _ in block.named_parameters())


def distinct_blocks(blocks_name: str, blocks: BlockStack) -> list[tuple[str, nn.Module]]:
    """(name, block) of the first block of each kind (:func:`block_kind`), pipeline stand-ins left out.

    Example::

        distinct_blocks("model.layers", jamba.model.layers)   # [("model.layers.0", mamba), ("model.layers.1", attn)]
    """
    first: dict[tuple, tuple[str, nn.Module]] = {}
    for name, block in zip(block_names(blocks_name, blocks), block_modules(blocks)):
        if not getattr(block, "is_pipeline_placeholder", False):
            first.setdefault(block_kind(block), (name, block))
    return list(first.values())


def _chosen_set(module: nn.Module, override: Sequence[str] | Callable[[str, nn.Module], bool]) -> BlockSet:
    named = dict(module.named_modules())
    if callable(override):
        picked = [n for n, m in named.items() if n and override(n, m)]
        names = [n for n in picked if not any(n.startswith(p + ".") for p in picked)]  # outermost only
        if not names:
            raise ValueError(
                f"blocks={override!r} chose no module of {type(module).__name__}; it is called as fn(name, module) "
                f"for every submodule (names look like {_sample_names(module)})."
            )
    else:
        names = list(override)
        missing = [n for n in names if n not in named or not n]
        if missing or not names:
            raise ValueError(
                f"blocks={names!r}: {missing or 'the list is empty'} name no submodule of {type(module).__name__}; "
                f"module names look like {_sample_names(module)}."
            )
        nested = [n for n in names if any(n.startswith(p + ".") for p in names)]
        if nested:
            raise ValueError(f"blocks={names!r} lists {nested}, which lie inside other listed blocks; list each once.")
    return BlockSet(names, [named[n] for n in names])


def _holds_layers(container: nn.Module) -> bool:
    # A container holding an embedding is a whole model written as a Sequential (or litgpt's ModuleDict).
    return isinstance(container, _CONTAINERS) and not any(isinstance(c, nn.Embedding) for c in container.children())


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _named_stack(module: nn.Module, name: str) -> BlockStack:
    try:
        blocks = module.get_submodule(name)
    except AttributeError:
        stacks = [n for n, m in module.named_modules() if isinstance(m, BlockStack) and n]
        raise ValueError(
            f"blocks={name!r} names no submodule of {type(module).__name__}; its ModuleLists and Sequentials are "
            f"{stacks or 'none'} and module names look like {_sample_names(module)}."
        ) from None
    if isinstance(blocks, nn.ModuleDict) and len(blocks):
        return _dict_blocks(name, blocks)
    if not isinstance(blocks, BlockStack) or len(blocks) == 0:
        raise ValueError(
            f"blocks={name!r} is a {type(blocks).__name__}, not a non-empty nn.ModuleList, nn.Sequential or nn.ModuleDict of "
            "blocks; name the container itself (e.g. 'model.layers'), not one block or the whole model."
        )
    return blocks


def _sample_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_modules() if name][:8]
