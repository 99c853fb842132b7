"""Model discovery: where the transformer blocks are.

The blocks are the container of layers that holds most of the model's parameters, whatever their
classes: hybrid models mix attention blocks with Mamba or linear-attention blocks (Jamba, Bamba,
Qwen3-Next), MoE models mix dense and sparse blocks (DeepSeek-V3's first layers). A mixture-of-experts
layer's own list of experts sits inside a block, so it always holds fewer parameters than the list of
blocks around it. Two containers are supported: ``nn.ModuleList`` (a forward loops over it) and
``nn.Sequential`` (the forward calls it); a ``nn.ModuleDict`` of blocks is refused with the way out.
"""

from __future__ import annotations

from torch import nn

BlockStack = nn.ModuleList | nn.Sequential
"""The containers a model may hold its blocks in."""

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_blocks(module: nn.Module, override: str | None = None) -> tuple[str, BlockStack]:
    """The dotted name and the container (``nn.ModuleList`` or ``nn.Sequential``) of transformer blocks in ``module``.

    Without ``override`` it is the container of layers holding the most parameters, then the most
    children, then the outermost (``model.layers`` in Llama and Jamba, ``transformer.h`` in GPT-2); its
    blocks may be of different classes. A container with an ``nn.Embedding`` child holds a whole model,
    not its blocks, and ``module`` itself is never the blocks. ``override`` is a dotted submodule name
    (as in ``named_modules()``) for models where that guess is wrong.

    Arguments:
        module: the model, or the LightningModule holding it.
        override: the dotted name of the blocks' ModuleList or Sequential; ``None`` to search.

    Example::

        name, blocks = find_blocks(Llama(LlamaConfig.from_name("tiny")))   # ("layers", ModuleList(...))
        name, blocks = find_blocks(model, "decoder.stack")                 # a list the search would miss
    """
    if override is not None:
        return override, _named_stack(module, override)
    candidates = [
        (name, m, name.count(".")) for name, m in module.named_modules() if name and _holds_layers(m) and len(m)
    ]
    if not candidates:
        raise ValueError(
            f"No nn.ModuleList or nn.Sequential of blocks found in {type(module).__name__}; pass "
            f"blocks='dotted.name' naming the container of transformer blocks (module names look like "
            f"{_sample_names(module)})."
        )
    name, blocks, _ = max(candidates, key=lambda c: (_numel(c[1]), -c[2], len(c[1])))
    if isinstance(blocks, nn.ModuleDict):
        raise ValueError(_dict_message(name, blocks))
    return name, blocks


def block_names(blocks_name: str, blocks: BlockStack) -> list[str]:
    """The dotted name of each block, in order (``model.layers.0``; a Sequential's own keys where it has them).

    Example::

        block_names("model.layers", model.model.layers)   # ["model.layers.0", "model.layers.1", ...]
    """
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
    if isinstance(blocks, nn.ModuleDict):
        raise ValueError(_dict_message(name, blocks))
    if not isinstance(blocks, BlockStack) or len(blocks) == 0:
        raise ValueError(
            f"blocks={name!r} is a {type(blocks).__name__}, not a non-empty nn.ModuleList or nn.Sequential of "
            "blocks; name the container itself (e.g. 'model.layers'), not one block or the whole model."
        )
    return blocks


def _dict_message(name: str, blocks: nn.ModuleDict) -> str:
    return (
        f"The blocks look like the nn.ModuleDict {name!r} (keys {list(blocks)[:4]}), which lightning_llm cannot "
        "split into blocks: hold them in an nn.ModuleList or nn.Sequential, or pass blocks='dotted.name' naming "
        "one that does."
    )


def _sample_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_modules() if name][:8]
