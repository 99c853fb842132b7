"""Learned position tables a model indexes inside its forward, made global under context parallelism.

A model whose forward takes no ``position_ids`` computes positions from the length it is given. Under context
parallelism it is given ``T / C`` tokens (two zig-zag chunks), so those positions would restart in every shard.
One form is exact to fix from the dataflow: a learned absolute table outside the blocks looked up with
``0, 1, ..., T/C - 1`` (PyTorch's tutorials, nanoGPT: ``self.pos(torch.arange(T))``). That lookup's input is
replaced by this rank's global positions (:func:`global_position_tables`), so each token reads the row one process
reads for it.

Anything else a first forward reads as "the first T/C positions" (another ``torch.arange(T/C)``: a rotary table
built from it; a ``[:T/C]`` slice of a longer tensor: a cached rotary table, a causal-mask buffer) is not made
global, so such a model is refused at its first forward, naming what was read and the fix (pass ``position_ids``);
so is a model that read no position table at all (a recurrent or position-free stack). Cached tables built from
``arange`` once and sliced later (OLMo-core, litgpt) are not rebuilt: substituting both the build and the slices
would map the positions twice. The tables are found in the first forward (their input is exactly ``0..T/C-1``);
later forwards substitute for those tables only, with no check on values (no host sync per step). The package's own
CP attention runs outside the watch (:func:`cp_own_code`).
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
    """What one forward read as local positions: replaced table lookups, and everything else seen."""

    length: int = 0
    positions: torch.Tensor | None = None
    tables: set[int] = field(default_factory=set)  # id() of the embeddings found to be position tables
    reads: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # (what, its result), first forward only
    fed_tables: list[torch.Tensor] = field(default_factory=list)  # the results a table was looked up with
    watching: bool = True  # only the first forward is recorded
    checked: bool = False

    def unexplained(self) -> list[str]:
        """The reads whose result was not itself a table's input (a rotary table's ``arange``, a cache's slice)."""
        return [what for what, result in self.reads if not any(result is t for t in self.fed_tables)]


def _local_range_end(args: tuple, kwargs: dict) -> object:
    """The end of ``torch.arange(...)`` when it starts at 0 with step 1, else ``None``."""
    bounds = list(args) + [kwargs[k] for k in ("start", "end", "step") if k in kwargs]
    if len(bounds) == 1:
        return bounds[0]
    if len(bounds) in (2, 3) and bounds[0] == 0 and (len(bounds) == 2 or bounds[2] == 1):
        return bounds[1]
    return None


def _slices_first(tensor: torch.Tensor, key: object, length: int) -> bool:
    """Whether ``tensor[key]`` keeps the first ``length`` entries of a dimension longer than ``length``."""
    entries = key if isinstance(key, tuple) else (key,)
    if any(e is Ellipsis for e in entries):  # (not ``in``: entries may be tensors, compared by ``==``)
        return False
    dims = [e for e in entries if e is not None]
    for dim, entry in enumerate(dims[: tensor.dim()]):
        if (
            isinstance(entry, slice)
            and entry.start in (None, 0)
            and entry.step in (None, 1)
            and entry.stop == length
            and tensor.shape[dim] > length
        ):
            return True
    return False


class _WatchPositions(TorchFunctionMode):
    """Records ``torch.arange(T/C)`` calls and ``[:T/C]`` slices of longer tensors made by the model's forward."""

    def __init__(self, reads: PositionReads) -> None:
        super().__init__()
        self.state = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state, result = self.state, func(*args, **kwargs)
        if not _IN_CP_CODE.get():
            if func is torch.arange and _local_range_end(args, kwargs) == state.length:
                state.reads.append((f"torch.arange({state.length})", result))
            elif func is torch.Tensor.__getitem__ and _slices_first(args[0], args[1], state.length):
                state.reads.append((f"a [:{state.length}] slice of a {tuple(args[0].shape)} tensor", result))
        return result


def _is_local_range(ids: object, length: int) -> bool:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() == 0 or ids.shape[-1] != length:
        return False
    return bool((ids == torch.arange(length, device=ids.device)).all())


def global_position_tables(
    model: nn.Module, blocks: list[nn.Module], reads: PositionReads, *, where: str
) -> list[RemovableHandle]:
    """Replace the input of each ``nn.Embedding`` outside ``blocks`` looked up with ``0..T/C-1`` by the global
    positions in ``reads``; watch the first forward and refuse it if it read positions any other way.

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
            if reads.watching and _is_local_range(args[0], reads.length):  # the first forward finds the tables
                reads.tables.add(id(module))
                reads.fed_tables.append(args[0])
            if id(module) not in reads.tables or args[0].shape[-1] != reads.length:
                return None
            return (reads.positions.to(args[0].device, args[0].dtype).expand_as(args[0]), *args[1:])

    for module in model.modules():
        if isinstance(module, nn.Embedding) and id(module) not in inside:
            handles.append(module.register_forward_pre_hook(lookup))
    handles += _watch_first_forward(model, reads, where)
    return handles


def _watch_first_forward(model: nn.Module, reads: PositionReads, where: str) -> list[RemovableHandle]:
    watch, active = _WatchPositions(reads), [False]

    def enter(module, args):
        if reads.watching:
            watch.__enter__()
            active[0] = True

    def leave(module, args, output):  # also when the forward raised (hooks are not removed while torch runs them)
        if active[0]:
            watch.__exit__(None, None, None)
            active[0] = reads.watching = False

    def check(module, args, output):  # the first forward decides; later ones run unwatched
        if not reads.checked:
            reads.checked = True
            unexplained = reads.unexplained()
            reads.reads, reads.fed_tables = [], []  # the first forward's tensors are not kept
            _refuse_unexplained(reads, unexplained, where, model)

    # Entered after the input-sharding hook (which sets the length), left before the output is gathered.
    return [
        model.register_forward_pre_hook(enter),
        model.register_forward_hook(leave, prepend=True, always_call=True),
        model.register_forward_hook(check),
    ]


def _refuse_unexplained(reads: PositionReads, unexplained: list[str], where: str, model: nn.Module) -> None:
    if reads.tables and not unexplained:
        return

    what = (
        f"it read {', '.join(dict.fromkeys(unexplained))}, which the package does not make global"
        if unexplained
        else "it looked up no position table with 0..T-1 (a recurrent or position-free model)"
    )
    raise ValueError(
        f"{where}.forward({', '.join(inspect.signature(model.forward).parameters)}) takes no `position_ids`, and "
        f"under context parallelism each rank holds a shard of every sequence: {what}. Only a learned position "
        "table outside the blocks looked up with torch.arange(T) is made global. Give the forward a "
        "`position_ids` argument (global positions of the tokens it receives), or use context_parallel_size=1."
    )
