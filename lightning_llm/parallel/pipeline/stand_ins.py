"""Parameter-free stand-ins for what this pipeline rank does not hold, and the pruning that puts them in place.

Every rank keeps the whole LightningModule structure but only the parameters of its stages: blocks of other ranks
become :class:`RemovedBlock` (keeping their plain attributes, which a forward may read), embeddings off the first
stage become :class:`ZeroEmbedding`, other modules the forward runs before the blocks (an embedding's norm:
Bloom's ``word_embeddings_layernorm``, ModernBERT's ``embeddings.norm``) become :class:`PassThrough`, and what
follows the blocks off the last stage becomes :class:`Unreachable`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from lightning_llm._compat.torch import module_parameters
from lightning_llm.modeling.blocks import BlockStack
from lightning_llm.parallel.pipeline.stage_state import StageChunk


class RemovedBlock(nn.Module):
    """Stands in for a block another pipeline rank holds (no parameters)."""

    is_pipeline_placeholder = True

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.attributes = plain_attributes(block)

    def forward(self, *args, **kwargs):
        raise RuntimeError("A block of another pipeline stage was called outside the pipeline schedule.")


class Shadow:
    """A submodule of a block another rank holds, as its plain attributes (and its submodules' shadows): a model's
    forward may read them off its first block (``nn.TransformerEncoder`` reads ``layers[0].self_attn.batch_first``)."""

    def __init__(self, module: nn.Module) -> None:
        self.__dict__.update(plain_attributes(module))


def plain_attributes(module: nn.Module) -> dict[str, Any]:
    """``module``'s public attributes that are neither tensors nor modules, with a :class:`Shadow` per submodule."""
    plain = {k: v for k, v in vars(module).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)}
    return {**plain, **{name: Shadow(child) for name, child in module.named_children()}}


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding on stages after the first: the real input arrives from the previous stage."""

    is_pipeline_placeholder = True

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding_dim, self.dtype = embedding.embedding_dim, embedding.weight.dtype
        # Models read the embedding's device off its weight (Llama 4: input_ids.to(embed_tokens.weight.device)):
        # an empty stand-in that follows the module's device and is in no checkpoint.
        empty = torch.empty(0, self.embedding_dim, dtype=self.dtype, device=embedding.weight.device)
        self.register_buffer("weight", empty, persistent=False)

    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # An embedding subclass may take more (OPT's learned positions: the attention mask, then position_ids=);
        # the first argument has the (batch, sequence) shape of the lookup either way.
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype, device=ids.device)


class PassThrough(nn.Module):
    """Stands in for a module that runs between the embeddings and the blocks (a norm, a scale) on stages after the
    first: it returns its input, whose value the stage replaces with the activation it receives."""

    is_pipeline_placeholder = True

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden


class Unreachable(nn.Module):
    """Stands in for what follows the blocks on ranks without the last stage."""

    is_pipeline_placeholder = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.module_name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"{self.module_name!r} runs after the transformer blocks, yet was called on a pipeline rank without the "
            "last stage. Pipeline parallelism needs everything but embeddings to follow the block loop."
        )


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


def outer_modules(
    module: nn.Module, blocks_name: str, called_before: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """Modules with parameters outside the blocks: (before the blocks, after them).

    Before: the embeddings and the modules ``called_before`` (those the traced forward called before its first block
    and not after it: :class:`~lightning_llm.modeling.structure.TracedBlocks`, its ``before``); after: the rest.
    """
    prefix = blocks_name + "."
    before, after = [], []
    for name, m in module.named_modules():
        if not name or name.startswith(prefix) or name == blocks_name or not module_parameters(m):
            continue
        (before if isinstance(m, nn.Embedding) or name in called_before else after).append(name)
    return before, after


def prune_to_stages(
    module: nn.Module,
    blocks_name: str,
    blocks: BlockStack,
    chunks: list[StageChunk],
    called_before: Collection[str] = (),
) -> dict[str, list]:
    """Drop what this rank's stages do not run; return the module names each stage owns (for its runner).
    ``called_before``: as :func:`outer_modules` takes it."""
    owned = {i for c in chunks for i in c.blocks}
    container = module.get_submodule(blocks.container) if getattr(blocks, "container", None) else None
    for index, key in enumerate(list(container or range(len(blocks)))):
        if index not in owned:
            blocks[index] = RemovedBlock(blocks[index])
            if container is not None:  # a ModuleDict's blocks: the dict itself holds the stand-in
                container[key] = blocks[index]
    before, after = outer_modules(module, blocks_name, called_before)
    has_first, has_last = any(c.is_first for c in chunks), any(c.is_last for c in chunks)
    for name in before if not has_first else []:
        outer = module.get_submodule(name)
        set_submodule(module, name, ZeroEmbedding(outer) if isinstance(outer, nn.Embedding) else PassThrough())
    for name in after if not has_last else []:
        set_submodule(module, name, Unreachable(name))
    return {
        "before": before if has_first else [],
        "after": after if has_last else [],
    }
