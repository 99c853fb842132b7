"""Counting what autograd keeps, block by block: the tally and the hooks that fill it during one forward.

A ``saved_tensors_hooks`` pack hook sees every tensor autograd keeps; storages are counted once per block and
parameters not at all. The "op" number (selective checkpointing by operator) adds the block's input to the outputs
of the ops the selective policy saves, seen by a ``TorchDispatchMode``; that is what torch's selective checkpoint
caches. ``StorageWeakRef`` (private) tells storages apart. :mod:`lightning_llm.modeling.activations` runs the
forwards (real or on fake tensors) under :func:`counting`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_llm._compat.torch import TorchDispatchMode, tree_leaves
from lightning_llm._compat.torch_distributed import local_tensor
from lightning_llm.modeling.structure import AttentionCalls, sequence_mixers
from lightning_llm.modeling.tp_shares import TensorParallelShares


@dataclass
class BlockActivations:
    """Bytes one block keeps for backward under each policy.

    Attributes:
        saved: without checkpointing (everything autograd saves).
        input: with full checkpointing (only the block's input, its first tensor argument).
            Other tensor arguments (rotary tables, masks) are shared by all blocks and counted in none.
        op: with selective per-operator checkpointing (input + outputs the policy saves);
            ``None`` when not measured.
        mixers: of ``saved``, the bytes saved inside the block's sequence mixers other than attention
            (:func:`~lightning_llm.modeling.structure.sequence_mixers`): context parallelism runs those on whole
            sequences, so they are not split C ways when the micro-batch is not
            (:mod:`lightning_llm.parallel.cp.gathered`).
        attends: whether the block ran an attention call; context parallelism runs a block that runs none whole,
            on whole sequences, like a mixer.
    """

    saved: int
    input: int
    op: int | None = None
    mixers: int = 0
    attends: bool = True

    @property
    def gathered(self) -> int:
        """Of ``saved``, the bytes context parallelism keeps on whole sequences: the block's all if it runs no
        attention, else its sequence mixers'."""
        return self.mixers if self.attends else self.saved


class MeasuredBlocks(list):
    """One :class:`BlockActivations` per block, and ``outside``: bytes saved outside the blocks (the embedding's
    output, the final norm, the head's input and the logits the loss keeps), counted once per storage."""

    outside: int = 0


class _Dropped:
    """Stands in for a saved tensor in a measuring pass that never runs backward."""


def _local(t: torch.Tensor) -> torch.Tensor:
    # The shard itself, without to_local()'s autograd node (this runs inside autograd's pack hook).
    return local_tensor(t) if isinstance(t, DTensor) else t


def storage_of(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference that tells ``t``'s storage (a DTensor's local shard's) apart from every other."""
    return StorageWeakRef(_local(t).untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().nbytes()


class BlockTally:
    """Per-block byte counts, filled by the hooks of :func:`counting` while a forward runs."""

    def __init__(
        self,
        num_blocks: int,
        params: Sequence[torch.Tensor],
        keep: bool,
        shares: TensorParallelShares | None = None,
    ) -> None:
        self.current: int | None = None
        self.shares = shares  # under tensor parallelism: one rank's share of each tensor, else all of it
        self.keep = keep  # False: hand autograd a stand-in, so the pass holds one block's activations at most
        self.params = {storage_of(p) for p in params}
        self.saved, self.input, self.op = [0] * num_blocks, [0] * num_blocks, [0] * num_blocks
        self.mixers, self.in_mixer = [0] * num_blocks, 0  # bytes saved inside sequence mixers; how deep in them
        self.ran, self.attends = [False] * num_blocks, [False] * num_blocks
        self.outside = 0
        self._outside: dict[object, torch.Tensor] = {}
        self._shared: set[StorageWeakRef] = set()
        # Tensors counted in the running block, held so that their storages' weak refs stay unique.
        self._saved: dict[object, torch.Tensor] = {}
        self._op: dict[StorageWeakRef, torch.Tensor] = {}

    def _bytes(self, t: torch.Tensor, fraction: float = 1.0) -> int:
        return int(_nbytes(t) * fraction)

    def enter(self, index: int, args: tuple, kwargs: dict) -> None:
        self.current, self._saved, self._op = index, {}, {}
        self.ran[index] = True
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        hidden = tensors[0] if tensors else None
        # Other inputs (rotary tables, masks) are the model's, shared by every block: counted in none.
        self._shared = {storage_of(t) for t in tensors[1:]} - ({storage_of(hidden)} if tensors else set())
        if hidden is not None:
            share = self.shares.fraction(hidden) if self.shares is not None else 1.0
            self.input[index] = int(_local(hidden).numel() * _local(hidden).element_size() * share)
            self.op[index] = self.input[index]
            self._op[storage_of(hidden)] = hidden

    def attended(self) -> None:
        if self.current is not None:
            self.attends[self.current] = True

    def leave(self) -> None:
        self.current, self._saved, self._op = None, {}, {}

    def pack(self, t: torch.Tensor):
        ref = storage_of(t)
        fraction, key = self.shares.weigh(t, ref) if self.shares is not None else (1.0, ref)
        if self.current is None:
            if ref not in self.params and key not in self._outside:
                self._outside[key] = t  # held (also when dropping) so that its weak ref stays unique
                self.outside += self._bytes(t, fraction)
        elif ref not in self.params and ref not in self._shared and key not in self._saved:
            self._saved[key] = t
            self.saved[self.current] += self._bytes(t, fraction)
            if self.in_mixer:
                self.mixers[self.current] += self._bytes(t, fraction)
        return t if self.keep else _Dropped()

    def op_output(self, out) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_of(t) not in self._op:
                self._op[storage_of(t)] = t
                self.op[self.current] += self._bytes(t, self.shares.fraction(t) if self.shares is not None else 1.0)

    def result(self, with_op: bool) -> MeasuredBlocks:
        blocks = MeasuredBlocks(
            BlockActivations(s, i, o if with_op else None, m, a)
            for s, i, o, m, a in zip(self.saved, self.input, self.op, self.mixers, self.attends)
        )
        blocks.outside = self.outside
        return blocks


class _SavedOutputs(TorchDispatchMode):
    """Counts the outputs of the ops a selective checkpointing policy would save."""

    def __init__(self, tally: BlockTally, saves_output: Callable) -> None:
        super().__init__()
        self.tally, self.saves_output = tally, saves_output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tally.current is not None and self.saves_output(func):
            self.tally.op_output(out)
        return out


def _unpack(_packed):
    raise RuntimeError("A forward run to measure activation memory cannot be differentiated.")


@contextmanager
def counting(blocks: Sequence[nn.Module], tally: BlockTally, saves_output: Callable | None):
    """While open, every forward through ``blocks`` is counted into ``tally``: the tensors autograd saves and, with
    ``saves_output``, the outputs of the ops the selective policy would save."""
    with ExitStack() as stack:
        for index, block in enumerate(blocks):
            pre = block.register_forward_pre_hook(lambda m, a, k, i=index: tally.enter(i, a, k), with_kwargs=True)
            post = block.register_forward_hook(lambda m, a, o: tally.leave())
            stack.callback(pre.remove)
            stack.callback(post.remove)
            for mixer in sequence_mixers(block):
                handles = (
                    mixer.register_forward_pre_hook(lambda *_: setattr(tally, "in_mixer", tally.in_mixer + 1)),
                    mixer.register_forward_hook(
                        lambda *_: setattr(tally, "in_mixer", tally.in_mixer - 1), always_call=True
                    ),
                )
                stack.callback(handles[0].remove)
                stack.callback(handles[1].remove)
        stack.enter_context(
            torch.autograd.graph.saved_tensors_hooks(tally.pack, (lambda t: t) if tally.keep else _unpack)
        )
        stack.enter_context(torch.enable_grad())
        stack.enter_context(AttentionCalls(tally.attended))
        if tally.shares is not None:  # before the selective count, which reads the marks it sets
            stack.enter_context(tally.shares.tracking())
        if saves_output is not None:
            stack.enter_context(_SavedOutputs(tally, saves_output))
        yield
