"""Model discovery: where the transformer blocks are."""

from __future__ import annotations

from torch import nn


def find_blocks(module: nn.Module, override: str | None = None) -> tuple[str, nn.ModuleList]:
    """The dotted name and the ``nn.ModuleList`` of transformer blocks in ``module``.

    Without ``override`` it is the largest ModuleList whose children all share one class
    (``model.layers`` in Llama, ``transformer.h`` in GPT-2).

    Example::

        name, blocks = find_blocks(CausalLM("tiny").model)   # ("layers", ModuleList(...))
    """
    if override is not None:
        try:
            blocks = module.get_submodule(override)
        except AttributeError:
            raise ValueError(f"blocks={override!r} names no submodule; module names look like {_sample_names(module)}.") from None
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ValueError(f"blocks={override!r} is a {type(blocks).__name__}, not a non-empty nn.ModuleList of blocks.")
        return override, blocks
    candidates = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and _one_class(m)]
    if not candidates:
        raise ValueError(
            f"No nn.ModuleList of same-class blocks found in {type(module).__name__}; pass blocks='dotted.name' "
            f"(module names look like {_sample_names(module)})."
        )
    return max(candidates, key=lambda c: (len(c[1]), sum(p.numel() for p in c[1].parameters())))


def _one_class(blocks: nn.ModuleList) -> bool:
    # Stand-ins for blocks held by other pipeline stages do not count against "same class".
    classes = {type(c) for c in blocks.children() if not getattr(c, "is_pipeline_placeholder", False)}
    return len(classes) == 1


def _sample_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_modules() if name][:8]
