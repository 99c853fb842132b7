"""Sequence mixers other than attention under context parallelism: each computes on whole sequences.

Attention crosses the CP ranks by the ring or Ulysses (:mod:`.interception`). A recurrent or convolutional mixer
(Mamba, Mamba-2, gated delta-net, short convolutions: each holds an ``nn.Conv1d`` over the sequence) cannot be split
that way without knowing its internals, and neither can a block whose forward runs no attention call at all (an
eager softmax, a linear recurrence written out, or only an MLP). Such a module runs unchanged, brought to its
inputs by hooks on it (nothing on the module changes). Where its first forward shows it local (its output at ``t``
reads only a few positions before ``t``, and no absolute position: a short convolution, an MLP), each rank runs it
on its own chunks, each after the positions before it (:mod:`.halo`). Otherwise it runs on whole sequences, in one
of two ways, both exact for any module:

- **by batch rows** when the micro-batch divides by C: an all-to-all gives rank ``c`` the whole sequences of rows
  ``c·B/C ... (c+1)·B/C - 1`` (Ulysses' exchange, over the batch instead of the heads, which a mixer's input
  projection mixes), and a second returns each output to its zig-zag shard. Compute, activations and traffic
  stay 1/C, as for attention;
- **on one rank in turn** otherwise (a micro-batch of one, or an input with the batch dimension but no sequence):
  the module's owner gathers the whole batch's sequences, runs it and sends each rank its positions of the output
  (:mod:`.owner`); the mixers of successive blocks are owned by successive ranks, so each rank keeps the activations
  of 1/C of them, whole. The compute is not divided (the other ranks wait). A warning says so at its first
  forward (once per module type and micro-batch).

Inputs shaped like the block's hidden states (batch, seq / C, ...) are brought to whole sequences (one with a
batch of 1 is broadcast, so it is gathered); outputs of the whole length go back to this rank's shard.

Which modules (:func:`gathered_mixers`), from the traced forward's attention calls:

- in a block that runs attention, each child holding an ``nn.Conv1d`` wider than one step (Falcon-H1's Mamba-2
  beside attention, a hybrid's mixer child); a child running attention and such a convolution both is refused;
- a block that runs no attention call: each such conv child when it has one (the rest of the block, norms and
  MLPs, stays on 1/C of the sequence), else the whole block (also when the convolution is its direct child).

Without a trace (blocks named by the user) only the conv children are gathered; a block running no attention is
then refused at its first forward, as before (:mod:`.interception`).
"""

from __future__ import annotations

import warnings
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.hooks import RemovableHandle

from lightning_llm.modeling.structure import is_sequence_conv
from lightning_llm.parallel.cp.collectives import all_to_all, gather_sequence
from lightning_llm.parallel.cp.halo import Halos
from lightning_llm.parallel.cp.layout import CPGroup, gathered_to_global, zigzag_positions
from lightning_llm.parallel.cp.owner import STAND_IN_LENGTH, from_owner, leaves, plain, to_owner
from lightning_llm.parallel.cp.positions import cp_own_code

_GATHERED: ContextVar[bool] = ContextVar("lightning_llm_cp_gathered", default=False)


def in_gathered() -> bool:
    """Whether the running code is inside a module that computes on the gathered (whole) sequence."""
    return _GATHERED.get()


@dataclass(frozen=True)
class GatheredMixer:
    """A module run on the gathered sequence: its name, the module, and whether it is a whole block."""

    name: str
    module: nn.Module
    whole_block: bool


def inside(name: str, prefix: str) -> bool:
    """Whether the module named ``name`` is ``prefix`` or inside it."""
    return name == prefix or name.startswith(prefix + ".")


def _conv_children(block_name: str, block: nn.Module, attends: set[str] | None) -> list[GatheredMixer]:
    mixers = []
    for child_name, child in block.named_children():
        if not any(map(is_sequence_conv, child.modules())):
            continue
        name = f"{block_name}.{child_name}"
        if is_sequence_conv(child) or (attends is not None and any(inside(a, name) for a in attends)):
            raise ValueError(
                f"context parallelism runs a convolution over the sequence (a Mamba / short-convolution mixer) on "
                f"the gathered sequence and the block's attention by the ring or Ulysses, but {name} "
                f"({type(child).__name__}) {'is the convolution itself' if is_sequence_conv(child) else 'holds both'}, "
                "so neither can be told apart from the other; wrap the convolution in a module of its own (called "
                "with (batch, seq, ...) inputs), or use context_parallel_size=1 for this model."
            )
        mixers.append(GatheredMixer(name, child, whole_block=False))
    return mixers


def gathered_mixers(names: list[str], blocks: list[nn.Module], attends: set[str] | None) -> list[GatheredMixer]:
    """The modules of ``blocks`` (named ``names``) that compute on the gathered sequence (see the module doc).

    ``attends``: the modules the traced forward ran attention in, or ``None`` without a trace.

    Example::

        gathered_mixers(["model.layers.0"], [layer], traced.attends)   # [GatheredMixer("model.layers.0.mamba", ...)]
    """
    mixers = []
    for name, block in zip(names, blocks):
        attending = attends is None or any(inside(a, name) for a in attends)
        if attending:
            mixers += _conv_children(name, block, attends)
        elif any(map(is_sequence_conv, block.children())) or not any(is_sequence_conv(m) for m in block.modules()):
            mixers.append(GatheredMixer(name, block, whole_block=True))  # the conv is the block's own step
        else:
            mixers += _conv_children(name, block, attends)
    return mixers


class _WholeSequences:
    """The hooks of one module run on whole sequences: how its inputs got there, undone on its outputs.
    ``owner``: the rank that runs it when it cannot split by batch rows (:mod:`.owner`)."""

    def __init__(self, cp: CPGroup, owner: int) -> None:
        self.cp, self.owner, self.calls, self.specs = cp, owner, [], {}
        self.halos = Halos(cp)  # where the module is local (:mod:`.halo`)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict):
        hidden = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        if hidden is None:
            raise TypeError(
                f"context parallelism runs {type(module).__name__} on whole sequences, so it needs its "
                "(batch, seq, ...) input as a tensor argument; it got none."
            )
        batch, local = hidden.shape[:2]
        if self.halos.local(module, (args, kwargs), hidden, local):
            self.calls.append(_unwatched())
            return self.halos.extend((args, kwargs), local)
        split = _splits_by_batch(batch, local, self.cp.size, (args, kwargs))
        # Under sequence parallelism the hidden states are DTensors over the TP ranks: the module runs whole there
        # too (tensor parallelism keeps these mixers whole), and its outputs go back to the input's placements.
        layout = (hidden.device_mesh, hidden.placements) if isinstance(hidden, DTensor) else None
        if split:
            args, kwargs = apply_to_collection((args, kwargs), torch.Tensor, self._by_rows(batch, local))
            stand_ins = None
        else:
            _warn_gathered(type(module).__name__, batch, self.cp.size, self.owner)
            args, kwargs, stand_ins = self._to_owner((args, kwargs), local)
        rows = batch // self.cp.size if split else None
        key = (tuple(hidden.shape), hidden.dtype, module.training, _autocast(hidden.device.type))
        self.calls.append((rows, local * self.cp.size, layout, _unwatched(), stand_ins, key))
        return args, kwargs

    def _by_rows(self, batch: int, local: int):
        def whole(t: torch.Tensor) -> torch.Tensor:
            if not _seq(t, local):
                return t
            t = t.full_tensor() if isinstance(t, DTensor) else t
            if t.shape[0] == batch:
                return _to_batch_shard(t, self.cp)
            return gather_sequence(t, self.cp, dim=1, backward="sum")  # broadcast over the batch: all rows use it

        return whole

    def _to_owner(self, inputs: tuple, local: int):
        """``inputs`` with their sequence tensors whole on the owner, their first positions elsewhere; and the
        stand-ins the backward reaches this rank's inputs through."""
        shards = [t for t in leaves(inputs) if _seq(t, local)]
        wholes = to_owner(shards, self.cp, self.owner)
        if self.cp.rank != self.owner:
            wholes, stand_ins = [plain(t)[:, :STAND_IN_LENGTH] for t in shards], wholes
        else:
            stand_ins = []
        supply = iter(wholes)
        args, kwargs = apply_to_collection(inputs, torch.Tensor, lambda t: next(supply) if _seq(t, local) else t)
        return args, kwargs, stand_ins

    def leave(self, module: nn.Module, args: tuple, kwargs: dict, output):
        if len(self.calls[-1]) == 2:  # run with halos
            _watched(*self.calls.pop())
            return self.halos.cut(output)
        rows, length, layout, unwatched, stand_ins, key = self.calls.pop()
        _watched(*unwatched)
        local = length // self.cp.size
        if rows is None:
            output = from_owner(output, length, self.cp, self.owner, stand_ins, self.specs, key)

        def back(t: torch.Tensor) -> torch.Tensor:
            if rows is not None:
                if not _seq(t, length):
                    return t
                t = _to_sequence_shard(t, self.cp) if t.shape[0] == rows else t.index_select(1, _own(self.cp, t))
            elif not _seq(t, local):
                return t
            if layout is None or isinstance(t, DTensor):
                return t
            mesh, placements = layout
            return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
                mesh, placements
            )

        return apply_to_collection(output, torch.Tensor, back)


def _unwatched() -> tuple:
    """Enter a module computing on sequences of its own (whole, or chunks with halos): attention in it is plain
    (:func:`in_gathered`) and the positions it computes are not watched; :func:`_watched` leaves."""
    own = cp_own_code()
    own.__enter__()
    return _GATHERED.set(True), own


def _watched(flag, own) -> None:
    own.__exit__(None, None, None)
    _GATHERED.reset(flag)


def _autocast(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` (``None`` when off): what a module's outputs follow."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _own(cp: CPGroup, t: torch.Tensor) -> torch.Tensor:
    return zigzag_positions(t.shape[1], cp.size, cp.rank, t.device)


def _warn_gathered(kind: str, batch: int, cp: int, owner: int) -> None:
    reason = (
        f"the micro-batch of {batch} does not divide by cp={cp}"
        if batch % cp
        else "an input besides its (batch, sequence, ...) ones has the batch dimension"
    )
    warnings.warn(
        f"context parallelism runs {kind} on the whole gathered micro-batch on one rank ({reason}; rank {owner} "
        f"for this one, the mixers of successive blocks in turn): exact, and each rank keeps the activations of "
        f"1/{cp} of such mixers, but its compute is not divided by {cp} (the other ranks wait). With a micro-batch "
        f"divisible by {cp} (and only (batch, sequence, ...) inputs) each rank runs it on batch / {cp} whole rows.",
        stacklevel=3,
    )


def _seq(tensor: torch.Tensor, length: int) -> bool:
    return tensor.dim() >= 2 and tensor.shape[1] == length


def _splits_by_batch(batch: int, local: int, cp: int, inputs: tuple) -> bool:
    """Whether the inputs go to whole sequences by batch rows: the batch divides by ``cp`` and no input other than
    the (batch, seq / C, ...) ones has the batch dimension (it would need splitting by a rule of its own)."""
    if batch % cp:
        return False
    others = []
    apply_to_collection(inputs, torch.Tensor, lambda t: others.append(t) if not _seq(t, local) else None)
    return not any(t.dim() >= 1 and t.shape[0] == batch for t in others)


def _to_batch_shard(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """(batch, seq / C, ...) zig-zag shard -> (batch / C, seq, ...) in global order: rank c keeps rows c·B/C..."""
    b, n, *rest = x.shape
    received = all_to_all(x.reshape(cp.size, b // cp.size, n, *rest), cp)  # slot c: rank c's tokens, these rows
    full = received.transpose(0, 1).reshape(b // cp.size, cp.size * n, *rest)
    return full.index_select(1, gathered_to_global(cp.size * n, cp.size, x.device))


def _to_sequence_shard(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """(batch / C, seq, ...) in global order -> (batch, seq / C, ...) zig-zag shard (inverse of the above)."""
    rows, seq, *rest = x.shape
    order = torch.argsort(gathered_to_global(seq, cp.size, x.device))  # global -> ranks' shards, rank 0 first
    slots = x.index_select(1, order).reshape(rows, cp.size, seq // cp.size, *rest).transpose(0, 1)
    received = all_to_all(slots, cp)  # slot c: this rank's tokens, rank c's rows
    return received.reshape(cp.size * rows, seq // cp.size, *rest)


def gather_mixers(mixers: list[GatheredMixer], cp: CPGroup) -> list[RemovableHandle]:
    """Run each of ``mixers`` on the gathered sequence (hooks on the module; nothing on it changes).

    Example::

        gather_mixers(gathered_mixers(names, blocks, traced.attends), cp)
    """
    handles, owners = [], {}
    for mixer in mixers:
        block = mixer.name if mixer.whole_block else mixer.name.rpartition(".")[0]
        hooks = _WholeSequences(cp, owners.setdefault(block, len(owners) % cp.size))
        handles.append(mixer.module.register_forward_pre_hook(hooks.enter, with_kwargs=True))
        handles.append(mixer.module.register_forward_hook(hooks.leave, with_kwargs=True, always_call=True))
    return handles
