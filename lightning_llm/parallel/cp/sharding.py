"""The model's input sharded along the sequence and its output gathered back: no change to the LightningModule.

A forward pre-hook on the model (the LightningModule's child that holds the blocks) keeps this rank's zig-zag
chunks of the token ids and passes their global ``position_ids`` (packed-document ids, the reference model's
``document_ids``, are taken out of the call and applied by the CP attention, :mod:`.masks`); every layer from the embedding to the output head
then computes on ``seq / cp`` tokens. A forward hook gathers the output (logits) back to the whole sequence in
global order, so the user's ``training_step`` computes its own loss, whatever it is (shifted cross entropy, ignored
labels, ...), on the same logits as one process: the loss is exact by construction. Gradients flow back to each
rank's own positions (:mod:`.collectives`). The gathered logits cost one (batch, seq, vocab) tensor per rank; a
loss computed on the shard (labels sharded with the inputs, as torchtitan does) is the next step. A model whose
forward takes no ``position_ids`` has its learned position table looked up by global position (:mod:`.positions`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_llm.parallel.cp.collectives import gather_sequence
from lightning_llm.parallel.cp.layout import CPGroup, zigzag_positions
from lightning_llm.parallel.cp.masks import record_documents
from lightning_llm.parallel.cp.positions import PositionReads, global_position_tables

# Inputs that would need sharding rules of their own (a padding mask, precomputed embeddings, labels that HF would
# shift inside the shard): refused by name rather than silently misread.
_REFUSED = {
    "attention_mask": "a padding mask",
    "inputs_embeds": "precomputed embeddings",
    "labels": "labels (the model would compute its loss on one shard; compute it from the logits in training_step)",
}


def _record_documents(args: tuple, kwargs: dict, ids: torch.Tensor, takes_documents: bool) -> tuple:
    """Take the packed-document ids out of the call (the model then computes plain causal attention) and record them
    for the CP attention, which applies them by global position (:mod:`.masks`); returns the remaining args."""
    documents = kwargs.pop("document_ids", None) if takes_documents else None
    if takes_documents and len(args) > 1:
        documents, args = args[1], args[:1] + args[2:]
    if documents is not None and (not isinstance(documents, torch.Tensor) or documents.shape != ids.shape):
        raise ValueError(
            f"document_ids must be a tensor shaped like the token ids {tuple(ids.shape)}; got "
            f"{tuple(documents.shape) if isinstance(documents, torch.Tensor) else type(documents).__name__}."
        )
    record_documents(documents)
    return args


def _shard_inputs(cp: CPGroup, takes_use_cache: bool, takes_documents: bool, reads: PositionReads | None):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise TypeError(
                f"context parallelism shards the model's token ids, a (batch, seq) tensor passed first or as "
                f"input_ids; {type(module).__name__} got {type(ids).__name__}."
            )
        for name, what in _REFUSED.items():
            value = kwargs.get(name)
            if value is None or (name == "attention_mask" and bool(value.all())):
                kwargs.pop(name, None)
                continue
            raise ValueError(f"context parallelism does not shard {what} (`{name}`) yet; call the model without it.")
        args = _record_documents(args, kwargs, ids, takes_documents)
        if len(args) > 1:
            raise ValueError(
                f"context parallelism does not shard extra positional inputs of {type(module).__name__} yet (only "
                "`document_ids`, the package's packed-document ids); call the model without them or with "
                "context_parallel_size=1."
            )
        positions = zigzag_positions(ids.shape[1], cp.size, cp.rank, ids.device)
        if reads is not None:  # no position_ids argument: the model's position table is looked up by these
            reads.length, reads.positions = len(positions), positions
        else:
            given = kwargs.get("position_ids")
            kwargs["position_ids"] = (
                positions.expand(ids.shape[0], -1) if given is None else given.index_select(-1, positions)
            )
        if takes_use_cache and kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False  # a KV cache of one shard is of no use and costs memory
        local = ids.index_select(1, positions)
        if args:
            return (local,), kwargs
        kwargs["input_ids"] = local
        return args, kwargs

    return hook


def _gather_output(cp: CPGroup):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output):
        if isinstance(output, torch.Tensor):
            return gather_sequence(output, cp, dim=1, backward="replicated")
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            output.logits = gather_sequence(logits, cp, dim=1, backward="replicated")
            return output
        raise TypeError(
            f"context parallelism gathers the model's logits, a tensor or an output with `.logits`; "
            f"{type(module).__name__} returned {type(output).__name__}."
        )

    return hook


def shard_model_io(
    model: nn.Module, cp: CPGroup, blocks: list[nn.Module] = (), where: str = "model", blocks_whole: bool = False
) -> list[RemovableHandle]:
    """Shard ``model``'s token ids (and positions) on the way in and gather its logits on the way out.

    A forward without ``position_ids`` gets its learned position table (outside ``blocks``) looked up by global
    position, or is refused at its first forward (:func:`~.positions.global_position_tables`) unless ``blocks_whole``
    (every block runs whole on whole sequences, so none sees a shard's positions).

    Example::

        handles = shard_model_io(lightning_module.model, CPGroup(group, 2, rank))
        logits = lightning_module.model(tokens)   # whole sequence; the blocks saw seq / 2 tokens
    """
    parameters = list(inspect.signature(model.forward).parameters)
    takes_documents = parameters[1:2] == ["document_ids"]  # the package's models: forward(tokens, document_ids, ...)
    reads = None if "position_ids" in parameters else PositionReads(refuse_position_free=not blocks_whole)
    handles = [
        model.register_forward_pre_hook(
            _shard_inputs(cp, "use_cache" in parameters, takes_documents, reads), with_kwargs=True
        ),
        model.register_forward_hook(_gather_output(cp), with_kwargs=True),
    ]
    if reads is not None:
        handles += global_position_tables(model, list(blocks), reads, where=where)
    return handles
