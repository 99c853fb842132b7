"""Model discovery: where the transformer blocks are."""

from __future__ import annotations

from torch import nn


def find_blocks(module: nn.Module, override: str | None = None) -> tuple[str, nn.ModuleList]:
    """The dotted name and the ``nn.ModuleList`` of transformer blocks in ``module``.

    Without ``override`` it is the largest ModuleList whose children all share one class
    (``model.layers`` in Llama, ``transformer.h`` in GPT-2). Largest means most parameters, then
    most children: the blocks hold nearly all of a model's weights, while a mixture-of-experts
    layer's list of experts can be longer than the list of layers. ``override`` is a dotted
    submodule name (as in ``named_modules()``) for models where that guess is wrong.

    Arguments:
        module: the model, or the LightningModule holding it.
        override: the dotted name of the blocks' ModuleList; ``None`` to search.

    Example::

        name, blocks = find_blocks(Llama(LlamaConfig.from_name("tiny")))   # ("layers", ModuleList(...))
        name, blocks = find_blocks(model, "decoder.stack")                 # a list the search would miss
    """
    if override is not None:
        return override, _named_list(module, override)
    candidates = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and _one_class(m)]
    if not candidates:
        mixed = [name for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        raise ValueError(
            f"No nn.ModuleList of same-class blocks found in {type(module).__name__}"
            + (f" (lists of mixed classes: {mixed})" if mixed else "")
            + f"; pass blocks='dotted.name' naming the list of transformer blocks (module names look like "
            f"{_sample_names(module)})."
        )
    return max(candidates, key=lambda c: (sum(p.numel() for p in c[1].parameters()), len(c[1])))


def _named_list(module: nn.Module, name: str) -> nn.ModuleList:
    try:
        blocks = module.get_submodule(name)
    except AttributeError:
        lists = [n for n, m in module.named_modules() if isinstance(m, nn.ModuleList)]
        raise ValueError(
            f"blocks={name!r} names no submodule of {type(module).__name__}; its ModuleLists are {lists or 'none'} "
            f"and module names look like {_sample_names(module)}."
        ) from None
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(
            f"blocks={name!r} is a {type(blocks).__name__}, not a non-empty nn.ModuleList of blocks; name the list "
            "itself (e.g. 'model.layers'), not one block or a container."
        )
    return blocks


def _one_class(blocks: nn.ModuleList) -> bool:
    # Stand-ins for blocks held by other pipeline stages do not count against "same class".
    classes = {type(c) for c in blocks.children() if not getattr(c, "is_pipeline_placeholder", False)}
    return len(classes) == 1


def _sample_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_modules() if name][:8]
