"""Positions a model computes inside its forward, made global under context parallelism.

A model whose forward takes no ``position_ids`` computes positions from the length it is given. Under context
parallelism it is given ``T / C`` tokens (two zig-zag chunks), so those positions would restart in every shard. Each
way of reading "the first T/C positions" seen in the forward reads this rank's global positions instead
(:func:`global_position_tables`), so every token gets what one process computes for it:

- ``torch.arange(T/C)`` (from 0, step 1) returns the global positions: a learned table looked up with it
  (PyTorch's tutorials, nanoGPT), a rotary table built from it, distances between positions;
- a ``[:T/C]`` slice (or ``narrow(dim, 0, T/C)``) of a longer tensor takes the rows at the global positions: a rotary
  cache or a table built for the longest sequence (litgpt's ``cos[:T]``);
- an ``nn.Embedding`` outside the blocks looked up with exactly ``0..T/C-1`` computed another way (a ``cumsum`` of
  ones) is looked up at the global positions; such tables are found in the first forward.

A read that was no position and indexes a local tensor with the global positions falls outside its range on every
rank (each rank holds a chunk of the sequence's second half), so it fails loudly instead of silently. A model whose
first forward read none of these (position-free, or positions computed some other way) is refused there, naming the
fix (pass ``position_ids``). The package's own CP code and the modules it runs on whole sequences (:mod:`.gathered`)
are not watched (:func:`cp_own_code`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

_IN_CP_CODE: ContextVar[bool] = ContextVar("lightning_llm_cp_own_code", default=False)


@contextmanager
def cp_own_code() -> Iterator[None]:
    """Run the package's own CP code unwatched: its ``arange`` calls and slices are already global."""
    token = _IN_CP_CODE.set(True)
    try:
        yield
    finally:
        _IN_CP_CODE.reset(token)


@dataclass
class PositionReads:
    """This forward's local length and global positions (set by the input-sharding hook), and what was read."""

    length: int = 0
    positions: torch.Tensor | None = None
    tables: set[int] = field(default_factory=set)  # id() of the embeddings found to be position tables
    read: list[str] = field(default_factory=list)  # what the first forward read as positions
    checked: bool = False
    # False where every block runs whole on whole sequences: only the blocks' computation depends on positions the
    # package could miss (a table outside them is still looked up globally, as read).
    refuse_position_free: bool = True


def _local_range_end(args: tuple, kwargs: dict) -> object:
    """The end of ``torch.arange(...)`` when it starts at 0 with step 1, else ``None``."""
    bounds = list(args) + [kwargs[k] for k in ("start", "end", "step") if k in kwargs]
    if len(bounds) == 1:
        return bounds[0]
    if len(bounds) in (2, 3) and bounds[0] == 0 and (len(bounds) == 2 or bounds[2] == 1):
        return bounds[1]
    return None


def _global_key(tensor: torch.Tensor, key: object, length: int, positions: torch.Tensor) -> object:
    """``key`` with its first ``:length`` slice of a longer dimension replaced by ``positions``; ``None`` if none.

    Only keys of slices, ints and ``None`` (an index tensor or ``...`` would change how the replacement indexes).
    """
    entries = list(key) if isinstance(key, tuple) else [key]
    if not all(e is None or isinstance(e, int | slice) for e in entries):
        return None
    dim = 0
    for index, entry in enumerate(entries):
        if entry is None:
            continue
        if (
            isinstance(entry, slice)
            and entry.start in (None, 0)
            and entry.step in (None, 1)
            and entry.stop == length
            and dim < tensor.dim()
            and tensor.shape[dim] > length
        ):
            entries[index] = positions.to(tensor.device)
            return tuple(entries)
        dim += 1
    return None


class _GlobalPositions(TorchFunctionMode):
    """Makes ``torch.arange(T/C)`` and ``[:T/C]`` slices / ``narrow(d, 0, T/C)`` of longer tensors read global
    positions while the model's forward runs."""

    def __init__(self, reads: PositionReads) -> None:
        super().__init__()
        self.state = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, state = kwargs or {}, self.state
        if _IN_CP_CODE.get() or state.positions is None:
            return func(*args, **kwargs)
        if func is torch.arange and _local_range_end(args, kwargs) == state.length:
            local = func(*args, **kwargs)
            self._record(f"torch.arange({state.length})")
            return state.positions.to(device=local.device, dtype=local.dtype)
        if func is torch.Tensor.__getitem__:
            key = _global_key(args[0], args[1], state.length, state.positions)
            if key is not None:
                self._record(f"a [:{state.length}] slice of a {tuple(args[0].shape)} tensor")
                return func(args[0], key)
        if func in (torch.Tensor.narrow, torch.narrow):
            tensor, dim, start, length = (*args, *kwargs.values())[:4]
            if start == 0 and length == state.length and tensor.shape[dim] > length:
                self._record(f"narrow({dim}, 0, {state.length}) of a {tuple(tensor.shape)} tensor")
                return tensor.index_select(dim, state.positions.to(tensor.device))
        return func(*args, **kwargs)

    def _record(self, what: str) -> None:
        if not self.state.checked:
            self.state.read.append(what)


def _is_local_range(ids: object, length: int) -> bool:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() == 0 or ids.shape[-1] != length:
        return False
    return bool((ids == torch.arange(length, device=ids.device)).all())


def global_position_tables(
    model: nn.Module, blocks: list[nn.Module], reads: PositionReads, *, where: str
) -> list[RemovableHandle]:
    """Make ``model``'s forward read global positions (see the module doc); refuse, at its first forward, a model
    that read none.

    ``reads.length`` / ``reads.positions`` are set by the input-sharding hook for every forward.

    Example::

        reads = PositionReads()
        handles = global_position_tables(model, list(model.layers), reads, where="model")
    """
    inside = {id(m) for block in blocks for m in block.modules()}
    handles: list[RemovableHandle] = []

    def lookup(module: nn.Module, args: tuple):
        if reads.positions is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        with cp_own_code():
            if not reads.checked and _is_local_range(args[0], reads.length):  # the first forward finds the tables
                reads.tables.add(id(module))
            if id(module) not in reads.tables or args[0].shape[-1] != reads.length:
                return None
            return (reads.positions.to(args[0].device, args[0].dtype).expand_as(args[0]), *args[1:])

    for module in model.modules():
        if isinstance(module, nn.Embedding) and id(module) not in inside:
            handles.append(module.register_forward_pre_hook(lookup))
    return handles + _watch_forward(model, reads, where)


def _watch_forward(model: nn.Module, reads: PositionReads, where: str) -> list[RemovableHandle]:
    mode, active = _GlobalPositions(reads), [False]

    def enter(module, args):
        mode.__enter__()
        active[0] = True

    def leave(module, args, output):  # also when the forward raised (hooks are not removed while torch runs them)
        if active[0]:
            mode.__exit__(None, None, None)
            active[0] = False

    def check(module, args, output):  # the first forward decides
        if not reads.checked:
            reads.checked = True
            if not reads.read and not reads.tables and reads.refuse_position_free:
                _refuse_position_free(where, model)

    # Entered after the input-sharding hook (which sets the length), left before the output is gathered.
    return [
        model.register_forward_pre_hook(enter),
        model.register_forward_hook(leave, prepend=True, always_call=True),
        model.register_forward_hook(check),
    ]


def _refuse_position_free(where: str, model: nn.Module) -> None:
    raise ValueError(
        f"{where}.forward({', '.join(inspect.signature(model.forward).parameters)}) takes no `position_ids`, and "
        "under context parallelism each rank holds a shard of every sequence: its first forward read no positions "
        "the package can make global (no torch.arange(T), no [:T] slice of a longer table, no position table "
        "looked up with 0..T-1; a recurrent or position-free model). Give the forward a `position_ids` argument "
        "(global positions of the tokens it receives), or use context_parallel_size=1."
    )
