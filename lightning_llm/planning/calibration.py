"""Measuring the rates :mod:`.step_time` prices work at, on the machine the run uses: seconds, nothing kept.

* the matmul rate at the model's own matmul shape (tokens x hidden by hidden x width), in the run's dtype;
* the memory bandwidth of an elementwise op on a tensor the size of the hidden states, and of zero-filling a fresh
  weight-sized tensor and adding it into another (a parameter's gradient in parts);
* the cost of one op beyond its work: a chain of tiny ops run forward and backward (dispatch, autograd, launch);
* what selective checkpointing's dispatch mode adds per op: the chain checkpointed selectively against fully;
* a process group's link: an all-reduce at two sizes, solved for latency and bandwidth (ranks call it together).

What a step adds around the work (collectives through DTensor and FSDP2, the optimizer) is in :mod:`.in_step`.

Each is the median of several timed repeats after a warm-up; with the ranks of a process group, the mean over a window
in which every rank runs it. On CUDA the device is synchronized around each timing.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from lightning_llm.planning.step_time import Link, Rates, work_time
from lightning_llm.planning.work import ForwardWork

_REPEATS = 7
Timer = Callable[[Callable[[], object], torch.device], float]


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int = _REPEATS) -> float:
    """Median seconds of ``fn()`` after two warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _concurrent_seconds(fn: Callable[[], object], device: torch.device, group=None, window: float = 0.3) -> float:
    """Mean seconds of ``fn()`` while every rank of ``group`` runs it too, back to back for about ``window`` seconds
    after a barrier: what a rank gets of a machine its ranks share. Where ranks outnumber cores (CPU processes) a
    rank's quickest repeats, timed alone, ran while the others waited, and credited it with cores it does not
    have in a step; on one device per rank the two agree. Every rank makes the same number of calls (the most any
    rank's first call asks for), so ``fn`` may hold collectives."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    calls = torch.tensor([max(3, math.ceil(window / max(time.perf_counter() - start, 1e-6)))], device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=group)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(int(calls.item())):
        fn()
        sync()
    return (time.perf_counter() - start) / int(calls.item())


def time_passes(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of ``fn()`` (a forward and backward of the model) over a few repeats after warm-up."""
    return _seconds(fn, device, repeats=5)


def matmul_rate(
    tokens: int, hidden: int, width: int, dtype: torch.dtype, device: torch.device, timer: Timer = _seconds
) -> float:
    """FLOP/s of a ``(tokens, hidden) @ (hidden, width)`` matmul."""
    a = torch.randn(tokens, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, width, dtype=dtype, device=device)
    return 2 * tokens * hidden * width / timer(lambda: a @ b, device)


def memory_bandwidth(numel: int, dtype: torch.dtype, device: torch.device, timer: Timer = _seconds) -> float:
    """Bytes/s of ``x * y`` (two reads and a write) on tensors of ``numel`` elements."""
    x, y = torch.randn(numel, dtype=dtype, device=device), torch.randn(numel, dtype=dtype, device=device)
    return 3 * x.numel() * x.element_size() / timer(lambda: x * y, device)


def fill_bandwidth(numel: int, dtype: torch.dtype, device: torch.device, timer: Timer = _seconds) -> float:
    """Bytes/s of a freshly allocated zero-filled tensor of ``numel`` elements added to another: what autograd does
    for each part of a parameter read in parts (its gradient as a zero-filled whole). At a weight's size the fresh
    allocation's first touch, not the cache, sets the rate (on this project's 2-core CPU host about half of
    :func:`memory_bandwidth`'s)."""
    into = torch.zeros(numel, dtype=dtype, device=device)
    return 2 * into.numel() * into.element_size() / timer(lambda: into.add_(torch.zeros_like(into)), device)


def op_overhead(device: torch.device, length: int = 64, timer: Timer = _seconds) -> float:
    """Seconds per op of a chain of ``length`` tiny ops run forward and backward, per forward op and its backward
    (3 units: :mod:`.step_time` prices a backward as two forwards)."""
    x = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.sum().backward()

    return timer(chain, device) / (3 * length)


def selective_checkpoint_overhead(device: torch.device, length: int = 64, timer: Timer = _seconds) -> float:
    """Seconds selective checkpointing's dispatch mode adds to each op, per pass (it sees every op of the forward and
    of the recompute): a chain of ``length`` tiny ops checkpointed under torch's selective contexts (every op
    recomputed) against the same chain fully checkpointed."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    x = torch.ones(8, device=device, requires_grad=True)

    def chain(y: torch.Tensor) -> torch.Tensor:
        for _ in range(length):
            y = y * 1.0001
        return y

    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        return create_selective_checkpoint_contexts(recompute_all)

    full = timer(lambda: checkpoint(chain, x, use_reentrant=False).sum().backward(), device)
    selective = timer(lambda: checkpoint(chain, x, use_reentrant=False, context_fn=contexts).sum().backward(), device)
    return max(selective - full, 0.0) / (2 * length)


def link(group=None, device: torch.device | None = None, sizes: tuple[int, int] = (2**10, 2**22)) -> Link:
    """Latency and bandwidth of ``group``'s all-reduce (every rank of it calls this together)."""
    n = dist.get_world_size(group)
    device = device or torch.device("cpu")
    small, large = (torch.ones(size // 4, device=device) for size in sizes)
    t_small, t_large = (_seconds(lambda t=t: dist.all_reduce(t, group=group), device) for t in (small, large))
    factor = 2 * (n - 1) / n
    bandwidth = factor * (sizes[1] - sizes[0]) / max(t_large - t_small, 1e-9)
    latency = max(t_small - factor * sizes[0] / bandwidth, 0.0) / (2 * (n - 1))
    return Link(bandwidth, latency)


def calibrate(*, tokens: int, hidden: int, width: int, dtype: torch.dtype, device: torch.device, group=None) -> Rates:
    """Every rate on this machine; ``group`` (an initialized process group, or ``None`` for the default one when
    initialized) gives the link, and its ranks time the work together (:func:`_concurrent_seconds`). Example::

        rates = calibrate(tokens=2048, hidden=4096, width=4096, dtype=torch.bfloat16, device=torch.device("cuda"))
    """
    shared = dist.is_initialized() and dist.get_world_size(group) > 1
    measured_link = link(group, device) if dist.is_initialized() else Link(float("inf"))
    timer = functools.partial(_concurrent_seconds, group=group) if shared else _seconds
    return Rates(
        matmul_flops=matmul_rate(tokens, hidden, width, dtype, device, timer),
        memory_bandwidth=memory_bandwidth(tokens * hidden, dtype, device, timer),
        op_overhead=op_overhead(device, timer=timer),
        link=measured_link,
        mode_overhead=selective_checkpoint_overhead(device, timer=timer),
        fill_bandwidth=fill_bandwidth(max(hidden * width * 8, 2**21), dtype, device, timer),
        overlap=device.type == "cuda",
    )


def fitted_to_model(rates: Rates, works: tuple[ForwardWork, ForwardWork], seconds: tuple[float, float]) -> Rates:
    """``rates`` fitted to two timed forward-and-backward passes of the model itself (at two sizes).

    The micro-benchmarks miss what the model's own ops cost: the Python and autograd work around each op, and how
    far its matmuls and elementwise ops fall short of the isolated ones. With ``t = 3 (ops x c + k x W)`` per pass (W
    the work's seconds at ``rates``, c the cost per op, k how much slower the work runs than measured alone), two
    passes give c and k; a degenerate fit (a negative c) keeps the measured overhead and fits k alone.

    Example::

        rates = fitted_to_model(rates, (work_at_256, work_at_128), (0.41, 0.23))
    """
    ops = [w.total.ops for w in works]
    work = [work_time(w.total, replace(rates, op_overhead=0.0)) for w in works]
    determinant = ops[0] * work[1] - ops[1] * work[0]
    per_op, scale = -1.0, 1.0
    if determinant:
        per_op = (seconds[0] * work[1] - seconds[1] * work[0]) / 3 / determinant
        scale = (ops[0] * seconds[1] - ops[1] * seconds[0]) / 3 / determinant
    if per_op < 0 or scale <= 0:
        per_op = rates.op_overhead
        scale = max(seconds[0] / 3 - ops[0] * per_op, 1e-12) / work[0]
    return replace(
        rates,
        matmul_flops=rates.matmul_flops / scale,
        memory_bandwidth=rates.memory_bandwidth / scale,
        op_overhead=per_op,
    )
