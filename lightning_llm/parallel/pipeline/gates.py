"""Pipeline parallelism for LightningModules whose model was not written for it.

Mechanism: a module-level split that keeps the user's code in charge. Every rank keeps the
whole LightningModule *structure* but only the parameters of its stages: blocks of other ranks
become parameter-free placeholders, embeddings become zero-producing stand-ins off the first
stage, and what follows the blocks (norm, head) disappears off the last stage. A stage runs the
user's own ``training_step`` on its micro-batch; the block list yields, while that stage is
active:

* the received activation in place of the hidden state at the stage's first block,
* pass-through calls for blocks outside the stage, returning the structure the stage's blocks return,
* an early exit (carrying the hidden state) after the stage's last block, unless it is the
  last stage, where the user's forward goes on to the head and the user's loss.

So any model whose forward loops over one ``nn.ModuleList`` of blocks (or calls one ``nn.Sequential``
of them) that each take the hidden state tensor first and return it (as a tensor, or first in a tuple
or dataclass: see :mod:`~lightning_llm.parallel.pipeline.block_outputs`) pipelines unchanged: the
reference Llama, Hugging Face Llama, GPT-2, GPT-Neo, Falcon, MPT, hybrids such as Jamba whose blocks
differ in class, and most decoders, with parameter names, checkpoints and tensor-parallel plans as before.
Graph tracing (``torch.distributed.pipelining.pipeline``) was not used: it needs the user's
``training_step`` (loss included) to export as one graph, which Hugging Face models and most
user code do not. The schedules, stages and communication are torch's
(``torch.distributed.pipelining``); only the stage boundary logic is ours.

This module holds the gates (the gated block container and embeddings) and what the block list yields; the stages'
shared state lives in :mod:`.stage_state`, the stand-ins for what other ranks hold and the pruning in
:mod:`.stand_ins`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm.modeling.blocks import BlockStack, block_modules, block_names
from lightning_llm.parallel.kv_cache import disable_kv_cache
from lightning_llm.parallel.pipeline.block_outputs import BlockOutputs, probe
from lightning_llm.parallel.pipeline.stage_state import PipelineState, StageChunk, StageOutput
from lightning_llm.parallel.pipeline.stand_ins import RemovedBlock, outer_modules, prune_to_stages

# The stage state and the pruning are imported from here too (the setup in parallelize.py, tests).
__all__ = ["PipelineState", "StageChunk", "StageOutput", "install_gates", "outer_modules", "prune_to_stages"]


def _hidden_arg_name(block: nn.Module) -> str:
    params = [p for p in inspect.signature(block.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
    return params[0].name if params else "hidden_states"


def _hidden(args: tuple, kwargs: dict, name: str) -> torch.Tensor:
    return args[0] if args else kwargs[name]


def _replace_hidden(args: tuple, kwargs: dict, name: str, value: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, name: value}


class _BlockCall:
    """What the block list yields for a block of the active stage."""

    def __init__(
        self, block: nn.Module, index: int, name: str, hidden_name: str, state: PipelineState, outputs: BlockOutputs
    ) -> None:
        self._block, self._index, self._name, self._hidden_name = block, index, name, hidden_name
        self._state, self._outputs = state, outputs

    def __call__(self, *args, **kwargs):
        chunk = self._state.active
        if self._index == chunk.blocks.start and not chunk.is_first:
            args, kwargs = _replace_hidden(args, kwargs, self._hidden_name, self._state.received)
        out = self._block(*args, **kwargs)
        hidden = self._outputs.hidden(self._block, out, self._name)
        if self._index == chunk.blocks.stop - 1 and not chunk.is_last:
            raise StageOutput(hidden)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block, name)


class _PassThrough:
    """What the block list yields for a block outside the active stage: returns its hidden-state input.

    In the structure the stage's own blocks return; ``stage_call`` learns it (by running the stage's first
    block on these arguments) if no block has run yet. Its attributes are the block's (a forward may read
    ``layer.attention_type`` to pick a mask), or for a block another rank holds, the plain attributes its
    placeholder kept.
    """

    def __init__(self, hidden_name: str, block: nn.Module, outputs: BlockOutputs, stage_call: Callable) -> None:
        self._hidden_name, self._block = hidden_name, block
        self._outputs, self._stage_call = outputs, stage_call

    def __call__(self, *args, **kwargs):
        hidden = _hidden(args, kwargs, self._hidden_name)
        return self._outputs.passed_through(hidden, lambda: self._stage_call(args, kwargs))

    def __getattr__(self, name: str) -> Any:
        block = self.__dict__["_block"]
        if isinstance(block, RemovedBlock):
            try:
                return block.attributes[name]
            except KeyError:
                raise AttributeError(name) from None
        return getattr(block, name)


class _Gate:
    """Iteration through the active pipeline stage, for a block container (installed by class swap)."""

    def _calls(self) -> list:
        state: PipelineState = self.__dict__["_pipeline_state"]
        chunk = state.active
        if chunk is None:
            raise RuntimeError(
                "The model was called outside the pipeline schedule; with pipeline parallelism every forward "
                "runs through LLMParallelStrategy's training/validation step."
            )
        outputs: BlockOutputs = self.__dict__["_block_outputs"]
        calls = []
        names = self.__dict__["_block_names"]
        for index, module in enumerate(block_modules(self)):  # every block: __iter__ below hides some
            hidden_name = self.__dict__["_hidden_names"][index]
            if index in chunk.blocks:
                calls.append(_BlockCall(module, index, names[index], hidden_name, state, outputs))
            else:
                calls.append(_PassThrough(hidden_name, module, outputs, self._probe_stage))
        return calls

    def _probe_stage(self, args: tuple, kwargs: dict) -> tuple[nn.Module, Any]:
        """The active stage's first block and its output on a pass-through's arguments, received activation in."""
        state: PipelineState = self.__dict__["_pipeline_state"]
        start = state.active.blocks.start
        block = block_modules(self)[start]
        if state.received is not None:
            args, kwargs = _replace_hidden(args, kwargs, self.__dict__["_hidden_names"][start], state.received)
        try:
            return block, probe(block, args, kwargs)
        except Exception as error:
            raise RuntimeError(
                f"Pipeline parallelism: to learn what {self.__dict__['_block_names'][start]} returns, it ran on the "
                f"arguments of a block before it on another stage and failed ({type(error).__name__}: {error}). Its "
                "blocks take per-layer arguments they cannot share (Zamba2's shared transformer looks up its layer "
                "index). Train this model with ZeRO instead of pipeline parallelism."
            ) from error

    def __iter__(self):
        return iter(self._calls())

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return self._calls()[idx]
        return self._calls()[idx] if isinstance(idx, int) else super().__getitem__(idx)


class _GatedBlocks(_Gate, nn.ModuleList):
    """The user's ``nn.ModuleList`` of blocks, iterated through the active pipeline stage."""


class _GatedSequential(_Gate, nn.Sequential):
    """The user's ``nn.Sequential`` of blocks: its own forward iterates it, so through the active stage."""


class _GatedDict(_Gate, nn.ModuleDict):
    """The user's ``nn.ModuleDict`` of blocks (torchtitan, OLMo-core: ``for block in self.blocks.values()``): its
    values, items and entries by key go through the active stage; its keys stay keys."""

    def __iter__(self):
        return iter(nn.ModuleDict.keys(self))

    def __getitem__(self, key):
        return self._calls()[list(nn.ModuleDict.keys(self)).index(key)]

    def values(self):
        return self._calls()

    def items(self):
        return list(zip(nn.ModuleDict.keys(self), self._calls()))


def _gated_embedding_class(base: type, state: PipelineState) -> type:
    # A second Trainer call on the same model gates it again: follow the new state, not the first one's gate.
    base = getattr(base, "_pipeline_base", base)

    def forward(self, ids, *args, **kwargs):
        if state.active is not None and state.active.is_first:
            return base.forward(self, ids, *args, **kwargs)
        if not isinstance(self, nn.Embedding):  # a norm between the embeddings and the blocks: see stand_ins
            return ids
        if isinstance(self.weight, DTensor):
            # A tensor-parallel embedding's output hook expects the DTensor (placements included) that
            # its lookup returns; zero times that lookup is it, and adds nothing to the weight's gradient.
            return base.forward(self, ids, *args, **kwargs) * 0
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.weight.dtype, device=ids.device)

    return type(f"PipelineGated{base.__name__}", (base,), {"forward": forward, "_pipeline_base": base})


def install_gates(
    module: nn.Module, blocks_name: str, blocks: BlockStack, owned_outer: dict[str, list], state: PipelineState
) -> None:
    """Make the block list and the embeddings follow ``state`` (the stage boundaries described above)."""
    disable_kv_cache(module, "Pipeline parallelism", "a training forward needs no KV cache; a stage holds some layers")
    modules = block_modules(blocks)
    hidden_names = [_hidden_arg_name(b) if not isinstance(b, RemovedBlock) else "hidden_states" for b in modules]
    names = block_names(blocks_name, blocks)
    gated = {nn.Sequential: _GatedSequential, nn.ModuleDict: _GatedDict}
    blocks.__class__ = next((g for base, g in gated.items() if isinstance(blocks, base)), _GatedBlocks)
    blocks.__dict__.update(
        _pipeline_state=state, _hidden_names=hidden_names, _block_names=names, _block_outputs=BlockOutputs()
    )
    for name in owned_outer["before"]:
        embedding = module.get_submodule(name)
        embedding.__class__ = _gated_embedding_class(type(embedding), state)
