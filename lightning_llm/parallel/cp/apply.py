"""Context parallelism applied to a LightningModule: check the model, route its attention, shard its input/output."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_llm.modeling.blocks import BlockStack, block_names
from lightning_llm.parallel.cp.gathered import GatheredMixer, gather_mixers, gathered_mixers, inside
from lightning_llm.parallel.cp.interception import route_attention
from lightning_llm.parallel.cp.layout import CPGroup
from lightning_llm.parallel.cp.sharding import shard_model_io
from lightning_llm.parallel.cp.ulysses import check_ulysses_heads
from lightning_llm.parallel.cp.variants import check_context_parallel_model
from lightning_llm.parallel.tp.attention_variants import head_count, is_attention, model_config

log = logging.getLogger(__name__)

METHODS = ("ring", "ulysses")  # how attention crosses the CP ranks: a send/recv ring, or all-to-all to whole heads


def check_method(method: str) -> str:
    """``method`` if it is one of :data:`METHODS` (LLMParallelStrategy checks its argument with this when built)."""
    if method not in METHODS:
        raise ValueError(f"context_parallel_method={method!r} is not one of 'ring', 'ulysses'.")
    return method


def context_parallel_model(module: nn.Module, blocks_name: str) -> tuple[str, nn.Module]:
    """The model whose input is sharded: the LightningModule's child holding the blocks (name, module)."""
    top = blocks_name.split(".")[0]
    if top == blocks_name:
        raise ValueError(
            f"context parallelism shards the input of the model holding the blocks, but the blocks {blocks_name!r} "
            f"are a direct child of {type(module).__name__}; hold the model (embedding, blocks, head) in one "
            "attribute of the LightningModule."
        )
    return top, module.get_submodule(top)


def check_context_parallel(
    module: nn.Module, *, blocks_name: str, blocks: list[nn.Module], pipelined: bool = False
) -> None:
    """Refuse, before anything is changed, a model context parallelism cannot split exactly (see :mod:`.variants`)."""
    name, model = context_parallel_model(module, blocks_name)
    check_context_parallel_model(model, blocks, where=name, pipelined=pipelined)


def refuse_blocks_not_called(blocks_name: str, blocks, called: set[str]) -> None:
    """Refuse blocks the model's forward does not call as modules (``called``: the traced forward's calls).

    CP routes and checks each block's attention from the block's forward hooks; a stack that runs its blocks through
    another method (yet-another-retnet's ``forward_parallel``) never enters them, so their attention would see only
    this rank's shard of every sequence with nothing to notice it.

    Example::

        refuse_blocks_not_called("model.layers", layers, traced.called)
    """
    names = block_names(blocks_name, blocks)
    skipped = [name for name in names if name not in called]
    if skipped:
        raise ValueError(
            f"context parallelism routes each block's attention from the block's forward hooks, but the model's forward "
            f"does not call {skipped[0]} ({len(skipped)} of {len(names)} blocks) as a module (it runs another of "
            "its methods, or calls its parts one by one), so its attention would see only this rank's shard of every "
            "sequence. Call the blocks as modules (`block(x)`), or use context_parallel_size=1 for this model."
        )


def _check_heads(module: nn.Module, blocks: list[nn.Module], cp: int, tp: int, mixers: list[GatheredMixer]) -> None:
    """Ulysses: refuse, at setup, query head counts that do not divide by cp × tp (gathered mixers keep theirs)."""
    config = model_config(module)
    kept = {id(m) for mixer in mixers for m in mixer.module.modules()}
    for block in blocks:
        for attention in filter(is_attention, block.modules()):
            heads = head_count(attention, config) if id(attention) not in kept else None
            if heads is not None:
                check_ulysses_heads(heads, None, cp, tp)


def apply_context_parallel(
    module: nn.Module,
    *,
    blocks_name: str,
    blocks: BlockStack,
    cp_mesh: DeviceMesh,
    method: str = "ring",
    tp: int = 1,
    pipelined: bool = False,
    attends: set[str] | None = None,
) -> str:
    """Split every sequence over ``cp_mesh`` from the embedding to the output (in place); returns a report line.

    ``attends``: the modules the traced forward ran attention in (``TracedBlocks.attends``); other sequence mixers
    run on the gathered sequence (:mod:`.gathered`).

    Example::

        dims = ParallelDims(world_size=2, cp=2)
        dims.build_mesh("cpu")
        apply_context_parallel(lightning_module, blocks_name="model.layers", blocks=layers, cp_mesh=dims.mesh["cp"])
    """
    check_method(method)
    check_context_parallel(module, blocks_name=blocks_name, blocks=blocks, pipelined=pipelined)
    name, model = context_parallel_model(module, blocks_name)
    names, blocks = block_names(blocks_name, blocks), list(blocks)
    mixers = gathered_mixers(names, blocks, attends)
    if method == "ulysses":
        _check_heads(model, blocks, cp_mesh.size(), tp, mixers)
    cp = CPGroup(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(), method)
    unrouted = {i for i, n in enumerate(names) if attends is not None and not any(inside(a, n) for a in attends)}
    route = route_attention(model, blocks, cp, blocks_name=blocks_name, unrouted=unrouted, traced=attends is not None)
    gather_mixers(mixers, cp)
    shard_model_io(model, cp, blocks, where=name, blocks_whole=sum(m.whole_block for m in mixers) == len(blocks))
    line = f"Applied context parallel (cp={cp.size}, {method}, zig-zag shards) to {len(blocks)} blocks via {route}"
    if mixers:
        kinds = sorted({type(m.module).__name__ for m in mixers})
        plural = "s" if len(mixers) > 1 else ""
        line += (
            f"; {len(mixers)} other sequence mixer{plural} ({', '.join(kinds)}) on the gathered sequence, or on "
            "their own positions with a halo where their first forward shows them local"
        )
    log.info(line)
    _warn_whole_blocks([m.name for m in mixers if m.whole_block], len(blocks))
    return line


def _warn_whole_blocks(names: list[str], total: int) -> None:
    if names:
        log.warning(
            f"{names[0]} ({len(names)} of {total} blocks) ran no attention call context parallelism can split "
            "(scaled_dot_product_attention, nn.MultiheadAttention, Hugging Face's attention functions): each such "
            "block runs on each rank's own positions with a halo where its first forward shows it reads only a few "
            "positions back (an MLP, a short convolution), else whole on whole sequences (by batch rows, or on one "
            "rank each in turn; exact, but its compute is not split). An eager softmax attention in it is split once "
            "it calls F.scaled_dot_product_attention."
        )
