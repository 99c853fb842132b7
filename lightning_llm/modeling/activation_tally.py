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
from lightning_llm.modeling.attention_saves import AttentionSaveCounter, AttentionSaves
from lightning_llm.modeling.structure import sequence_mixers
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
        attention: of ``saved``, what each ``scaled_dot_product_attention`` call saved, in the parts context
            parallelism divides differently (:mod:`~lightning_llm.modeling.attention_saves`).
    """

    saved: int
    input: int
    op: int | None = None
    mixers: int = 0
    attends: bool = True
    attention: tuple[AttentionSaves, ...] = ()

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
        self.attention: list[list[AttentionSaves]] = [[] for _ in range(num_blocks)]
        self._call: dict | None = None  # the running attention call's counts (see attention_call)
        self.outside = 0
        self._outside: dict[object, torch.Tensor] = {}
        self._shared: set[StorageWeakRef] = set()
        # Tensors counted in the running block, held so that their storages' weak refs stay unique.
        self._saved: dict[object, torch.Tensor] = {}
        self._op: dict[StorageWeakRef, torch.Tensor] = {}

    def _fraction(self, t: torch.Tensor) -> float:
        return self.shares.fraction(t) if self.shares is not None else 1.0

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
            self.input[index] = int(_local(hidden).numel() * _local(hidden).element_size() * self._fraction(hidden))
            self.op[index] = self.input[index]
            self._op[storage_of(hidden)] = hidden

    def attended(self) -> None:
        if self.current is not None:
            self.attends[self.current] = True

    def leave(self) -> None:
        self.current, self._saved, self._op = None, {}, {}

    @contextmanager
    def attention_call(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None):
        """Count what one attention call of the running block saves (:class:`AttentionSaves`)."""
        if self.current is None:
            yield
            return
        kv: dict[StorageWeakRef, int] = {}  # storage -> bytes of the keys and values on it (one fused storage: some)
        for t in (key, value):
            kv[storage_of(t)] = kv.get(storage_of(t), 0) + _local(t).numel() * _local(t).element_size()
        shape = (query.shape[-2], key.shape[-2])
        self._call = {"total": 0, "keys_values": 0, "mask": 0, "kv": kv, "shape": shape, "masked": mask is not None}
        try:
            yield
        finally:
            call, self._call = self._call, None
            broadcast = mask is None or mask.dim() < 4 or mask.stride(0) == 0  # one mask for every batch row
            rows = 1 if broadcast else mask.shape[0]
            whole = rows * shape[0] * shape[1] * query.element_size() if mask is not None else 0
            queries = int(_local(query).numel() * _local(query).element_size() * self._fraction(query))
            saves = AttentionSaves(call["total"], call["keys_values"], call["mask"], whole, queries)
            self.attention[self.current].append(saves)

    def _count_in_call(self, t: torch.Tensor, ref: StorageWeakRef, nbytes: int, fraction: float) -> None:
        call = self._call
        call["total"] += nbytes
        if ref in call["kv"]:  # of a q|k|v storage, the keys' and values' part
            call["keys_values"] += min(nbytes, int(call["kv"][ref] * fraction))
        elif call["masked"] and t.dim() == 4 and t.shape[1] == 1 and tuple(t.shape[-2:]) == call["shape"]:
            call["mask"] += nbytes

    def pack(self, t: torch.Tensor):
        ref = storage_of(t)
        fraction, key = self.shares.weigh(t, ref) if self.shares is not None else (1.0, ref)
        if self.current is None:
            if ref not in self.params and key not in self._outside:
                self._outside[key] = t  # held (also when dropping) so that its weak ref stays unique
                self.outside += self._bytes(t, fraction)
        elif ref not in self.params and ref not in self._shared and key not in self._saved:
            self._saved[key] = t
            nbytes = self._bytes(t, fraction)
            self.saved[self.current] += nbytes
            if self.in_mixer:
                self.mixers[self.current] += nbytes
            if self._call is not None:
                self._count_in_call(t, ref, nbytes, fraction)
        return t if self.keep else _Dropped()

    def op_output(self, out) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_of(t) not in self._op:
                self._op[storage_of(t)] = t
                self.op[self.current] += self._bytes(t, self._fraction(t))

    def result(self, with_op: bool) -> MeasuredBlocks:
        blocks = MeasuredBlocks(
            BlockActivations(s, i, o if with_op else None, m, a, tuple(c))
            for s, i, o, m, a, c in zip(self.saved, self.input, self.op, self.mixers, self.attends, self.attention)
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
        stack.enter_context(AttentionSaveCounter(tally.attended, tally.attention_call))
        if tally.shares is not None:  # before the selective count, which reads the marks it sets
            stack.enter_context(tally.shares.tracking())
        if saves_output is not None:
            stack.enter_context(_SavedOutputs(tally, saves_output))
        yield
