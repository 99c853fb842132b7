"""Local sequence mixers under context parallelism: each rank computes its own positions, reading a halo.

A short convolution (LFM2's), a token shift or a block of position-wise layers computes its output at position
``t`` from its inputs at ``t - w ... t`` only. Such a module need not run on whole sequences (:mod:`.gathered`):
each rank runs it on its own two chunks, each preceded by the ``w`` positions before it (its *halo*: the end of the
chunk before, from the rank that holds it), and keeps the outputs at its own positions. Compute, activations and
traffic stay about ``1/C`` at any micro-batch, one sequence included, where :mod:`.gathered` runs the module on one
rank at a time; ``w = 0`` (position-wise) needs no traffic at all.

Nothing is assumed about the module. At its first forward it is probed (:func:`receptive_width`) on the first
``PROBE`` positions of its real inputs, aside (no autograd, dropout off, caches left out): the forward-mode derivative
of the outputs with respect to the hidden states at each position in turn must be exactly zero at every earlier
output position and, from the first position, at the probe's last one (it reaches at most ``w`` positions ahead,
the largest reach with a nonzero derivative); then the module run on the same positions without the first few must
give the same outputs at the positions it still sees in full (it reads no absolute position). The ranks agree on
the largest ``w``. Derivatives, not perturbed outputs, decide: a recurrence whose contribution from a few positions
back is below the outputs' last bit (a fast-decaying head) still has a nonzero derivative there. A module failing
either check, with an op that has no forward-mode derivative (attention kernels, grouped expert matmuls), returning
a tensor without the sequence dimension, or whose halo would be longer than a chunk runs on whole sequences, as
before; so does one whose forward would run other code's hooks or collectives beside the run (split by tensor or
expert parallelism: its parts hold DTensors or hooks).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.autograd.forward_ad as fwad
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm._compat.torch import inner_hooks, outside_dispatch_modes
from lightning_llm.parallel.cp.collectives import gather_sequence
from lightning_llm.parallel.cp.layout import CPGroup, chunk_indices
from lightning_llm.parallel.cp.owner import leaves
from lightning_llm.parallel.tp.first_forward_parity import aside, close, without_caches

log = logging.getLogger(__name__)

PROBE = 16  # positions a module is probed on (fewer where a chunk is shorter)
_NOT_LOCAL = 1 << 30
_UNDECIDED = object()


def _is_seq(t: torch.Tensor, length: int) -> bool:
    return t.dim() >= 2 and t.shape[1] == length


def _cut(inputs: tuple, local: int, start: int, stop: int) -> tuple:
    """``inputs`` with each sequence tensor cut to positions ``start:stop`` (copies: a module writing into its input
    must not change the run's)."""
    return apply_to_collection(inputs, torch.Tensor, lambda t: t[:, start:stop].clone() if _is_seq(t, local) else t)


def _outputs(module: nn.Module, inputs: tuple, length: int) -> list[torch.Tensor] | None:
    """The module's floating output tensors on ``inputs``; ``None`` when one lacks the sequence dimension."""
    args, kwargs = inputs
    found = leaves(module.forward(*args, **kwargs))  # its own hooks (these, FSDP's) are not run again
    found = [t for t in found if t.is_floating_point()]
    return found if found and all(_is_seq(t, length) for t in found) else None


def _reach(module: nn.Module, inputs: tuple, length: int) -> list[list[int]] | None:
    """For each position of the hidden states, the output positions whose forward-mode derivative with respect to
    it is not exactly zero (no backward graph: tools hooked on modules' backward, a memory tracker, see nothing)."""
    hidden = next(t for t in leaves(inputs) if _is_seq(t, length) and t.is_floating_point())
    generator = torch.Generator(device=hidden.device).manual_seed(0)
    reach = []
    for position in range(length):
        tangent = torch.zeros_like(hidden)
        tangent[:, position] = torch.randn(hidden[:, position].shape, generator=generator, device=hidden.device)
        with fwad.dual_level():
            dual = fwad.make_dual(hidden, tangent)
            probe = apply_to_collection(inputs, torch.Tensor, partial(_swap, hidden, dual))
            outputs = _outputs(module, probe, length)
            if outputs is None:
                return None
            tangents = [fwad.unpack_dual(t).tangent for t in outputs]
        moved = [(t != 0).flatten(2).any(-1).any(0) for t in tangents if t is not None]
        reach.append(torch.nonzero(torch.stack(moved).any(0)).flatten().tolist() if moved else [])
    return reach


def _swap(old: torch.Tensor, new: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return new if t is old else t


def receptive_width(module: nn.Module, args: tuple, kwargs: dict, local: int) -> int | None:
    """How many positions before ``t`` the module's output at ``t`` reads (see the module doc); ``None`` where it
    is not local: it reads later positions, far back, an absolute position, or returns a non-sequence tensor.

    Example::

        receptive_width(short_conv, (hidden,), {}, hidden.shape[1])   # 2 for a causal convolution of kernel 3
    """
    length = min(PROBE, local // 2)  # within this rank's first chunk
    if length < 4 or inner_hooks(module) or any(isinstance(p, DTensor) for p in module.parameters()):
        return None  # too short to tell; or its forward runs others' hooks or collectives (split parts)
    inputs = without_caches(args, kwargs)  # a cache passed in would keep the probe's positions
    if not any(_is_seq(t, local) and t.is_floating_point() for t in leaves(inputs)):
        return None
    try:
        with aside(module), outside_dispatch_modes():
            reach = _reach(module, _cut(inputs, local, 0, length), length)
            if reach is None or any(r and (r[0] < s or r[-1] - s >= length - 1) for s, r in enumerate(reach)):
                return None  # an earlier output moves, or (from the first position) the probe's last one
            width = max((r[-1] - s for s, r in enumerate(reach) if r), default=-1)
            if width < 0 or sum(map(bool, reach)) < length // 2:  # (a padding mask's positions move nothing)
                return None
            base = _outputs(module, _cut(inputs, local, 0, length), length)
            start = max(1, min(width + 1, length - 1 - width))  # cut as far as leaves a position seen in full
            shifted = _outputs(module, _cut(inputs, local, start, length), length - start)
            same = shifted is not None and all(
                close(s[:, width:], b[:, start + width :]) for s, b in zip(shifted, base)
            )
            return width if same else None
    except Exception as error:  # the module cannot run on fewer positions: it is not probed, and runs whole
        log.debug("context parallel: %s not probed for locality: %s", type(module).__name__, error)
        return None


def agreed_width(width: int | None, chunk: int, cp: CPGroup, like: torch.Tensor) -> int | None:
    """The largest of the ranks' widths, ``None`` when any rank's is, or when it exceeds a ``chunk``.

    Example::

        agreed_width(2, 8, cp, hidden)   # 2 where every rank probed 2 or less, None where one probed None
    """
    agreed = torch.tensor([_NOT_LOCAL if width is None else width], device=like.device)
    with outside_dispatch_modes():
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=cp.group)
    value = int(agreed.item())
    return value if value <= chunk else None


def with_halos(t: torch.Tensor, width: int, cp: CPGroup) -> torch.Tensor:
    """This rank's zig-zag shard ``t`` (batch, 2 chunks, ...) with each chunk preceded by the ``width`` positions
    before it in the whole sequence (none before the first chunk); differentiable (the halo's gradient returns to
    the rank holding it).

    Example::

        with_halos(x, 2, cp)   # rank 1 of 2, chunks 1 and 2 of 4: (batch, 2 + n + 2 + n, ...)
    """
    if width == 0:
        return t
    chunk = t.shape[1] // 2
    cast = t.dtype == torch.bool  # gloo gathers no bool tensors
    tails = torch.cat([t[:, chunk - width : chunk], t[:, 2 * chunk - width :]], dim=1)
    tails = gather_sequence(tails.to(torch.uint8) if cast else tails, cp, dim=1, backward="sum")  # chunk j's at j·w
    tails = tails.bool() if cast else tails
    pieces = []
    for index, own in zip(chunk_indices(cp.size, cp.rank), (t[:, :chunk], t[:, chunk:])):
        if index > 0:
            pieces.append(tails[:, (index - 1) * width : index * width])
        pieces.append(own)
    return torch.cat(pieces, dim=1)


def own_positions(length: int, width: int, cp: CPGroup, device: torch.device) -> torch.Tensor:
    """The indices, in a sequence :func:`with_halos` extended to ``length``, of this rank's own positions.

    Example::

        own_positions(12, 2, cp, "cpu")   # rank 1 of 2, chunks of 4: tensor([2, 3, 4, 5, 8, 9, 10, 11])
    """
    first = 0 if chunk_indices(cp.size, cp.rank)[0] == 0 else width
    chunk = (length - first - width) // 2
    return torch.cat(
        [torch.arange(first, first + chunk, device=device), torch.arange(length - chunk, length, device=device)]
    )


class Halos:
    """The halo mode of one module's hooks (:mod:`.gathered`): decided at its first call, then each call's inputs
    extended by their halos and its outputs cut back to this rank's positions.

    Example::

        halos = Halos(cp)
        if halos.local(module, (args, kwargs), hidden, hidden.shape[1]):   # in the module's forward pre-hook
            args, kwargs = halos.extend((args, kwargs), hidden.shape[1])
        output = halos.cut(output)                                          # in its forward hook
    """

    def __init__(self, cp: CPGroup) -> None:
        self.cp, self.width, self.lengths = cp, _UNDECIDED, []

    def local(self, module: nn.Module, inputs: tuple, hidden: torch.Tensor, local: int) -> bool:
        """Whether ``module`` runs with halos on this call: probed on all ranks at its first call (under sequence
        parallelism, whose inputs are DTensors, never), and only while a chunk holds the halo (a later, shorter
        sequence runs whole)."""
        if self.width is _UNDECIDED:
            self.width = None if isinstance(hidden, DTensor) else self._probe(module, inputs, hidden, local)
        return self.width is not None and self.width <= local // 2

    def _probe(self, module: nn.Module, inputs: tuple, hidden: torch.Tensor, local: int) -> int | None:
        width = agreed_width(receptive_width(module, *inputs, local), local // 2, self.cp, hidden)
        if width is not None:
            log.info(
                "context parallel: %s reads %d position(s) back and no absolute position (probed): each rank runs "
                "it on its own positions with a halo of %d",
                *(type(module).__name__, width, width),
            )
        return width

    def extend(self, inputs: tuple, local: int) -> tuple:
        """``inputs`` with every (batch, seq / C, ...) tensor's chunks preceded by their halos."""
        self.lengths.append(local + self.width * (1 if self.cp.rank == 0 else 2))  # chunk 0 has none before it
        return apply_to_collection(
            inputs, torch.Tensor, lambda t: with_halos(t, self.width, self.cp) if _is_seq(t, local) else t
        )

    def cut(self, output):
        """``output`` with every tensor of the extended length cut to this rank's own positions."""
        length = self.lengths.pop()
        if self.width == 0:
            return output
        keep = lambda t: t.index_select(1, own_positions(length, self.width, self.cp, t.device))  # noqa: E731
        return apply_to_collection(output, torch.Tensor, lambda t: keep(t) if _is_seq(t, length) else t)
