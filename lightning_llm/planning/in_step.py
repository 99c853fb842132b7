"""What a training step adds around its work, measured as a step meets it: collectives through DTensor and FSDP2,
per ZeRO stage, and the optimizer's step over the parameters.

An isolated all-reduce of 1 KiB costs about 0.2 ms between 2 gloo ranks; the same collective between matmuls, through
DTensor or FSDP2, about 5 ms (the framework's work around it, the wait for the slower rank). FSDP2's stages differ in
more than their collectives: copying gradients into and out of the flat reduce buffer, dividing them, resharding.
And an optimizer over DTensor parameters pays a subclass dispatch per parameter and op (AdamW over the 39 tensors
of a 3M-parameter model: 28 ms on CPU, 25 of them with 8-element tensors). Each is timed on a small stand-in (a pair
of linear layers; AdamW over tensors of two sizes): the collectives' cost per call beyond an isolated collective
of their bytes, the optimizer's per tensor and per parameter. Every rank of ``mesh`` calls these together, and each
is timed while every rank runs it (``calibration._concurrent_seconds``), as in a step.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import replace

import torch
from torch import nn

from lightning_llm._compat.torch_distributed import replicate_with_fsdp
from lightning_llm.planning.calibration import _concurrent_seconds, _seconds, link
from lightning_llm.planning.step_time import Link, Rates

# Collectives per FSDP2 unit and step (one micro-batch), and their ring factors' sum times n/(n-1): ZeRO 0
# all-reduces the gradients (2); 2 all-gathers the parameters once and reduce-scatters (1 + 1); 3 all-gathers twice.
_ZERO_CALLS = {0: (1, 2), 2: (2, 2), 3: (3, 3)}
_MAX_UNIT_PARAMS = 2**26  # a stand-in unit's parameters at most (256 MiB in fp32): a 70B block's would not fit


class _Parts(nn.Module):
    """A ``inputs -> outputs`` linear layer held as ``parts`` weights (column blocks): a unit with a block's tensor count."""

    def __init__(self, inputs: int, outputs: int, parts: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(inputs, outputs // parts, bias=False) for _ in range(parts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _pair(hidden: int, width: int, device: torch.device, parts: int = 1) -> nn.Sequential:
    torch.manual_seed(0)
    if parts == 1:
        return nn.Sequential(nn.Linear(hidden, width, bias=False), nn.Linear(width, hidden, bias=False)).to(device)
    return nn.Sequential(_Parts(hidden, width, parts), _Parts(width, hidden - hidden % parts, parts)).to(device)


def _wrapped(stage: int, mesh, hidden: int, width: int, device: torch.device, parts: int = 1) -> nn.Sequential:
    """The pair data parallel as the strategy makes ZeRO ``stage``: each layer a unit, and the root."""
    from torch.distributed.fsdp import fully_shard

    pair = _pair(hidden, width, device, parts)
    for module in (*pair, pair):
        if stage == 0:
            replicate_with_fsdp(module, mesh=mesh)
        else:
            fully_shard(module, mesh=mesh, reshard_after_forward=stage == 3 and module is not pair)
    return pair


def tensor_parallel_link(mesh, tokens: int, hidden: int, width: int, device: torch.device, isolated: Link) -> Link:
    """Tensor parallelism's collectives in a step: a column split then a row split (torch's styles) forward and
    backward (two all-reduces) against the same layers whole on ``1/n`` of the work; the extra seconds per
    collective, beyond what ``isolated`` gives it, are the link's ``call_latency``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n = mesh.size()
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    timed = functools.partial(_concurrent_seconds, group=mesh.get_group())
    plain = timed(lambda m=_pair(hidden, width, device): m(x).sum().backward(), device)
    split = parallelize_module(_pair(hidden, width, device), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    per_collective = (timed(lambda: split(x).sum().backward(), device) - plain / n) / 2
    extra = per_collective - isolated.all_reduce(tokens * hidden * x.element_size(), n)
    return replace(isolated, call_latency=max(extra, 0.0))


def zero_links(
    mesh,
    tokens: int,
    hidden: int,
    width: int,
    device: torch.device,
    isolated: Link,
    rounds: int = 3,
    unit: tuple[int, int] | None = None,
) -> dict:
    """ZeRO stage -> its :class:`Link` as FSDP2 meets it in a step: the pair wrapped as the stage is against the pair
    unwrapped, timed in turn over ``rounds`` (a shared host drifts; each stage's median); the extra seconds per unit,
    beyond what ``isolated`` gives its collectives, are the stage's cost per collective (``call_latency``).

    FSDP2's work grows with a unit's tensors (each is copied into and out of the flat buffers, viewed and divided) and
    bytes beyond what an isolated collective of those bytes costs, so ``unit`` (a block's parameter tensors and
    parameters) makes each layer of the pair a unit like the model's: that many weights, that many parameters (on 64
    tokens: the units' compute is not what is measured). Without it each layer is one ``hidden x width`` weight.
    (Solving two sizes for a per-byte cost was tried: on a shared 2-core host the fitted bandwidth moved 20-fold.)"""
    n, parts = mesh.size(), 1
    if unit is not None:
        params = min(unit[1], _MAX_UNIT_PARAMS)
        parts, tokens = max(unit[0], 1), 64
        width = max(params // hidden // parts, 1) * parts
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    pairs = {None: _pair(hidden, width, device, parts)}
    pairs |= {s: _wrapped(s, mesh, hidden, width, device, parts) for s in _ZERO_CALLS}
    times: dict = {stage: [] for stage in pairs}
    timed = functools.partial(_concurrent_seconds, group=mesh.get_group(), window=0.15)
    for _ in range(rounds):
        for stage, pair in pairs.items():
            times[stage].append(timed(lambda m=pair: m(x).sum().backward(), device))
    plain, nbytes, links = statistics.median(times[None]), hidden * width * x.element_size(), {}
    for stage, (calls, factor) in _ZERO_CALLS.items():
        extra = (statistics.median(times[stage]) - plain) / 2  # per layer
        modelled = factor * (n - 1) / n * nbytes / isolated.bandwidth + calls * (n - 1) * isolated.latency
        links[stage] = replace(isolated, call_latency=max((extra - modelled) / calls, 0.0))
    return links


def optimizer_costs(device: torch.device, mesh=None, count: int = 32, sizes: tuple[int, int] = (8, 2**16)):
    """(seconds per parameter tensor, seconds per parameter) of an AdamW step (torch's defaults for the device), over
    DTensor parameters on ``mesh`` as every layout of the strategy holds them (plain tensors without one)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    seconds = []
    for size in sizes:
        params = []
        for _ in range(count):
            value = torch.zeros(size, device=device)
            params.append(nn.Parameter(value if mesh is None else distribute_tensor(value, mesh, [Replicate()])))
        for p in params:
            p.grad = torch.ones_like(p)
        step = torch.optim.AdamW(params, lr=1e-4).step
        seconds.append(
            _seconds(step, device, 15) if mesh is None else _concurrent_seconds(step, device, mesh.get_group())
        )
    per_param = max(seconds[1] - seconds[0], 0.0) / (count * (sizes[1] - sizes[0]))
    return seconds[0] / count - per_param * sizes[0], per_param


def in_step_rates(
    rates: Rates,
    mesh,
    *,
    tokens: int,
    hidden: int,
    width: int,
    device: torch.device,
    unit: tuple[int, int] | None = None,
) -> Rates:
    """``rates`` with the links and optimizer costs a step on ``mesh`` (1-D, every rank calls) meets; ``unit``: a
    block's (parameter tensors, parameters), for ZeRO's units (:func:`zero_links`). Example::

    rates = in_step_rates(calibrate(...), init_device_mesh("cuda", (8,)), tokens=4096, hidden=1024, width=1024,
                          device=torch.device("cuda"))
    """
    isolated = link(mesh.get_group(), device)
    zero = zero_links(mesh, tokens, hidden, width, device, isolated, unit=unit)
    per_tensor, per_param = optimizer_costs(device, mesh)
    return replace(
        rates,
        link=isolated,
        tp_link=tensor_parallel_link(mesh, tokens, hidden, width, device, isolated),
        dp_link=zero[3],
        zero_links=zero,
        optimizer_per_tensor=per_tensor,
        optimizer_per_param=per_param,
    )
