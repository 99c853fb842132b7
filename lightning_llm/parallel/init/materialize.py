"""Allocate a meta-device model's shards and initialize them exactly as the unsharded model would be.

Building on the meta device costs nothing; the model is then parallelized (pipeline split, TP,
FSDP2) while still on meta, and only here does each rank allocate what it holds. The values come
from the model's own init (see :mod:`lightning_llm.parallel.init.entry`), and, for the same seed,
equal bit for bit what that init gives the unsharded model in one process.

Why the random numbers are replayed by hand: DTensor's RNG tracker (``torch.distributed.tensor``'s
``OffsetBasedRNGTracker``) makes a sharded random op equal the unsharded one only on CUDA-like
devices (its constructor refuses CPU, ``is_rng_supported_mesh`` is False there), and it cannot
account for parameters a pipeline stage does not hold. So the init is run twice:

1. :func:`record_init` runs it on the whole meta model (free: meta ops draw no random numbers) and
   records the sequence of random fills: which parameter, which op, its shape;
2. :func:`materialize` allocates the shards and runs it again on the sharded model; each random fill
   of a sharded parameter draws the *full* tensor's numbers from the global generator and keeps
   this rank's slice, and the fills of parameters this rank does not hold (other pipeline stages)
   are drawn and discarded, so every rank's generator walks the same sequence as one process would.

Row-sharded (FSDP ``Shard(0)``) parameters are drawn in chunks of rows, so memory stays at the shard
plus one chunk; any other placement (TP, TP x FSDP) draws its full tensor once, then keeps its slice.
torch's CPU ``normal_`` fills 16 values at a time from a sequence of uniforms (``normal_fill``), so
chunks that start on a multiple of 16 elements and are at least 16 long give the same numbers as one
call; ``uniform_`` draws one number per element in order. Tests compare against one process.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_llm._compat.torch import TorchDispatchMode
from lightning_llm.parallel.init.entry import init_entry_points

_RANDOM_FILLS = {
    torch.ops.aten.normal_.default,
    torch.ops.aten.uniform_.default,
    torch.ops.aten.bernoulli_.float,
    torch.ops.aten.exponential_.default,
    torch.ops.aten.log_normal_.default,
    torch.ops.aten.random_.default,
    getattr(torch.ops.aten.random_, "from"),
    torch.ops.aten.random_.to,
    torch.ops.aten.cauchy_.default,
    torch.ops.aten.geometric_.default,
}
_CHUNKABLE = {torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default}
_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per drawn chunk


@dataclass
class RandomFill:
    """One random in-place fill of the init: the parameter's names (tied aliases included), the op, its arguments."""

    names: frozenset[str]
    op: object
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple
    kwargs: dict


def _names_by_id(module: nn.Module) -> dict[int, frozenset[str]]:
    names: dict[int, set[str]] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), set()).add(name)
    return {key: frozenset(value) for key, value in names.items()}


class _Recorder(TorchDispatchMode):
    def __init__(self, names: dict[int, frozenset[str]]) -> None:
        super().__init__()
        self.names, self.fills = names, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            target = args[0]
            self.fills.append(
                RandomFill(
                    self.names.get(id(target), frozenset()),
                    func,
                    tuple(target.shape),
                    target.dtype,
                    tuple(args[1:]),
                    dict(kwargs),
                )
            )
        return func(*args, **kwargs)


def record_init(module: nn.Module) -> list[RandomFill]:
    """Run the model's own init on the whole meta ``module`` and return its random fills, in order.

    Call it before the model is split or sharded. Example::

        with torch.device("meta"):
            model = Llama(config)
        fills = record_init(model)
    """
    recorder = _Recorder(_names_by_id(module))
    with torch.no_grad(), recorder:
        for _, init in init_entry_points(module):
            init()
    return recorder.fills


_scratch: dict[torch.dtype, torch.Tensor] = {}


def _scratch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` in one buffer reused by every draw of a materialization.

    Allocating a fresh buffer per parameter or chunk leaves the C allocator's heap fragmented and
    resident: measured on the 1B preset, ~36 MiB more RSS per block than the shard itself.
    """
    numel = math.prod(shape)
    buffer = _scratch.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch[dtype] = torch.empty(max(numel, _CHUNK_ELEMENTS), dtype=dtype)
    return buffer[:numel].view(shape)


def _draw(fill: RandomFill, keep_rows: tuple[int, int] | None = None, out: torch.Tensor | None = None):
    """Draw ``fill``'s full tensor from the global generator.

    Returns it whole (``keep_rows=None``), or copies rows ``keep_rows`` into ``out`` chunk by chunk
    (``out=None``: the numbers are only drawn, to keep the generator in step).
    """
    shape, numel = fill.shape, math.prod(fill.shape)
    if fill.op not in _CHUNKABLE or numel <= _CHUNK_ELEMENTS or not shape:
        full = _scratch_tensor(shape, fill.dtype)
        fill.op(full, *fill.args, **fill.kwargs)
        if keep_rows is None:
            return full
        if out is not None:
            out.copy_(full[keep_rows[0] : keep_rows[1]])
        return None
    keep_rows = (0, shape[0]) if keep_rows is None else keep_rows
    if out is None and keep_rows[1] > keep_rows[0]:
        out = torch.empty((keep_rows[1] - keep_rows[0], *shape[1:]), dtype=fill.dtype)
    row = numel // shape[0]
    step = 16 // math.gcd(16, row)  # rows per 16-element boundary
    rows_per_chunk = max(step, (_CHUNK_ELEMENTS // row) // step * step)
    buffer = _scratch_tensor((rows_per_chunk + step, *shape[1:]), fill.dtype)
    start = 0
    while start < shape[0]:
        end = min(shape[0], start + rows_per_chunk)
        if (shape[0] - end) * row < 16:  # normal_ refills its last 16 values: the tail chunk must hold them
            end = shape[0]
        chunk = buffer[: end - start]
        fill.op(chunk, *fill.args, **fill.kwargs)
        low, high = max(start, keep_rows[0]), min(end, keep_rows[1])
        if low < high:
            out[low - keep_rows[0] : high - keep_rows[0]].copy_(chunk[low - start : high - start])
        start = end
    return out


def _row_range(tensor: DTensor) -> tuple[int, int] | None:
    """This rank's rows when ``tensor`` is row-sharded on a 1-D mesh (torch.chunk's split), else ``None``."""
    if tensor.device_mesh.ndim != 1 or tensor.placements != (Shard(0),):
        return None
    size, ranks, rank = tensor.shape[0], tensor.device_mesh.size(), tensor.device_mesh.get_local_rank()
    per_rank = math.ceil(size / ranks)
    return min(size, rank * per_rank), min(size, (rank + 1) * per_rank)


def _fill_local(target: torch.Tensor, fill: RandomFill) -> None:
    """Fill this rank's part of ``target`` (the draw lives in the scratch buffer until the next draw)."""
    if not isinstance(target, DTensor):
        target.copy_(_draw(fill))
        return
    local = target.to_local()
    rows = _row_range(target)
    if rows is not None:
        _draw(fill, keep_rows=rows, out=local if local.numel() else None)
        return
    full = _draw(fill)
    if all(isinstance(p, Replicate) for p in target.placements):
        local.copy_(full)
    else:
        local.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local())


class _Replayer(TorchDispatchMode):
    """Replaces each random fill of the sharded init by the recorded full-tensor fill, sliced to this rank.

    A pipeline stage may hold its own copy of a weight tied to another stage's (the output head
    tied to the input embedding): the unsharded init filled that tensor once, earlier in the
    sequence, so its fill is redrawn from the generator state saved at that point.
    """

    def __init__(self, fills: list[RandomFill], names: dict[int, frozenset[str]]) -> None:
        super().__init__()
        self.fills, self.names, self.cursor = fills, names, 0
        self.states: dict[int, torch.Tensor] = {}

    def skip_to(self, index: int) -> None:
        for i in range(self.cursor, index):
            self.states[i] = torch.get_rng_state()
            _draw(self.fills[i], keep_rows=(0, 0))
        self.cursor = max(self.cursor, index)

    def _find(self, names: frozenset[str]) -> int | None:
        match = [
            i
            for i in range(len(self.fills))
            if (self.fills[i].names & names) or (not names and not self.fills[i].names)
        ]
        ahead = [i for i in match if i >= self.cursor]
        if ahead:
            return ahead[0]
        return next((i for i in reversed(match) if i in self.states and names), None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RANDOM_FILLS:
            return func(*args, **kwargs)
        target, names = args[0], self.names.get(id(args[0]), frozenset())
        index = self._find(names)
        if index is None or tuple(target.shape) != self.fills[index].shape:
            raise RuntimeError(
                f"The model's init filled {sorted(names) or 'an unnamed tensor'} (shape {tuple(target.shape)}) "
                "in an order or shape that differs from its run on the unsharded meta model; sharded values would "
                "not match. Make init depend only on the model's structure (not on the device or the layout)."
            )
        if index < self.cursor:  # a tied copy: redraw the earlier fill, then continue where we were
            now = torch.get_rng_state()
            torch.set_rng_state(self.states[index])
            _fill_local(target, self.fills[index])
            torch.set_rng_state(now)
            return target
        self.skip_to(index)
        self.states[index] = torch.get_rng_state()
        _fill_local(target, self.fills[index])
        self.cursor = index + 1
        return target


def check_same_rng_state(group=None) -> None:
    """Raise if the ranks' CPU generators differ: replicas and shards would be initialized inconsistently."""
    if not dist.is_initialized():
        return
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) > 1:
        raise RuntimeError(
            "The random number generators differ between ranks before the model's weights are initialized, so "
            "replicas would start from different weights. Seed every rank the same first, e.g. "
            "lightning.seed_everything(42), or call lightning_llm.parallel.seeding.agree_on_seed() just before "
            "(the strategies do: every rank then takes rank 0's seed)."
        )


def materialize(module: nn.Module, device: torch.device, fills: list[RandomFill]) -> list[str]:
    """Allocate every meta tensor of the (parallelized) ``module`` on ``device`` and initialize it exactly.

    ``fills`` comes from :func:`record_init` on the whole model. Returns the names of the modules
    whose init entry point ran. Tied parameters stay one tensor.

    Example::

        fills = record_init(model)          # whole model, on meta
        parallelize(model, dims, zero_stage=3)
        materialize(model, torch.device("cpu"), fills)
    """
    entries = init_entry_points(module)
    tied = [names for names in _names_by_id(module).values() if len(names) > 1]
    _to_empty_outside_metrics(module, device)
    _retie(module, tied)  # to_empty gives each module a new Parameter when leaving meta: ties would break
    check_same_rng_state()
    replayer = _Replayer(fills, _names_by_id(module))
    with torch.no_grad():
        with replayer:
            for _, init in entries:
                init()
        replayer.skip_to(len(fills))
    _scratch.clear()
    _check_ties(module, tied)
    return [name for name, _ in entries]


def _to_empty_outside_metrics(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)`` except inside torchmetrics metrics: their states are real tensors (Lightning
    moves them with the module), and ``to_empty`` would leave them uninitialized: a ``MeanMetric`` of the
    validation loss then starts from whatever the memory held (measured: val_loss -5.8e8 after 20 steps of the
    tiny model under ZeRO 3 on 2 ranks)."""
    metrics = [m for m in module.modules() if _is_metric(m)]
    inside = {id(sub) for metric in metrics for sub in metric.modules()}
    for sub in module.modules():
        if id(sub) not in inside:
            sub.to_empty(device=device, recurse=False)


def _is_metric(module: nn.Module) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return False
    return isinstance(module, Metric)


def _retie(module: nn.Module, tied: list[frozenset[str]]) -> None:
    by_name = dict(module.named_parameters(remove_duplicate=False))
    for names in tied:
        present = sorted(n for n in names if n in by_name)
        for name in present[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, by_name[present[0]])


def _check_ties(module: nn.Module, tied: list[frozenset[str]]) -> None:
    by_name = dict(module.named_parameters(remove_duplicate=False))
    for names in tied:
        present = {id(by_name[n]) for n in names if n in by_name}
        if len(present) > 1:
            raise RuntimeError(f"Parameters {sorted(names)} were tied before materialization and are not after it.")
