"""A module run on whole sequences by one context-parallel rank at a time, its owner.

Where a sequence mixer (Mamba, gated delta-net, a short convolution) cannot be split by batch rows (a micro-batch
of one, the long-context case; :mod:`.gathered`), running it on the whole gathered sequence on every rank would
keep its activations whole on every rank. The mixers take turns instead: each has an owner rank, which receives
every rank's shard of its sequence inputs (``gather``), runs it, and sends every rank its positions of the outputs
(``scatter``; outputs without the sequence dimension are broadcast); backward reverses each. With mixers owned
round-robin each rank keeps ``1/C`` of the mixers' activations, each whole. The compute is not divided (the others
wait), as it was not when every rank ran it.

The other ranks run the module on the first two positions of their shard: its parameters then take part in the
backward with zero gradients (every data-parallel wrapper reduces a gradient for every parameter of a unit, and
FSDP's hooks on the module fire on every rank alike), and the output's structure is known without running it whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor

from lightning_llm.parallel.cp.layout import CPGroup, gathered_to_global, zigzag_positions

STAND_IN_LENGTH = 2  # positions of its own shard a rank other than the owner runs the module on


def _global(cp: CPGroup, rank: int) -> int:
    """The default group's rank of ``cp``'s rank ``rank`` (collectives' ``src``/``dst`` on every supported torch)."""
    return rank if cp.group is None else dist.get_global_rank(cp.group, rank)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (a DTensor's whole value; differentiable)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class _ToOwner(torch.autograd.Function):
    """Each input's sequence shards (dim 1) to the owner, whole in global order; the others get an empty stand-in.
    Backward: the owner sends each rank its positions of each input's gradient."""

    @staticmethod
    def forward(ctx, cp: CPGroup, owner: int, *shards: torch.Tensor):
        ctx.cp, ctx.owner, ctx.metas = cp, owner, [(s.shape, s.dtype, s.device) for s in shards]
        outputs = []
        for shard in (s.contiguous() for s in shards):
            parts = [torch.empty_like(shard) for _ in range(cp.size)] if cp.rank == owner else None
            dist.gather(shard, parts, group=cp.group, dst=_global(cp, owner))
            if parts is None:
                outputs.append(shard.new_empty(0))
                continue
            whole = torch.cat(parts, dim=1)
            outputs.append(whole.index_select(1, gathered_to_global(whole.shape[1], cp.size, whole.device)))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        cp, owner, returned = ctx.cp, ctx.owner, []
        for (shape, dtype, device), grad, needed in zip(ctx.metas, grads, ctx.needs_input_grad[2:]):
            if not needed:
                returned.append(None)
                continue
            local = torch.empty(shape, dtype=dtype, device=device)
            parts = None
            if cp.rank == owner:
                positions = (zigzag_positions(grad.shape[1], cp.size, r, grad.device) for r in range(cp.size))
                parts = [grad.index_select(1, p).contiguous() for p in positions]
            dist.scatter(local, parts, group=cp.group, src=_global(cp, owner))
            returned.append(local)
        return None, None, *returned


class _FromOwner(torch.autograd.Function):
    """The owner's output leaves to every rank: its positions of each sequence leaf (``spec`` entry ``"seq"``), every
    other leaf whole. Inputs: the owner's leaves; elsewhere the stand-ins that tie the backward to the module.
    Backward: the owner gathers the sequence leaves' gradients and sums the others'."""

    @staticmethod
    def forward(ctx, cp: CPGroup, owner: int, spec: list, *inputs: torch.Tensor):
        ctx.cp, ctx.owner, ctx.spec, ctx.inputs = cp, owner, spec, [(t.shape, t.dtype, t.device) for t in inputs]
        outputs, leaves = [], iter(inputs)
        for kind, shape, dtype in spec:
            leaf = next(leaves).contiguous() if cp.rank == owner else None
            device = leaf.device if leaf is not None else inputs[0].device
            if kind == "seq":
                local_shape = (shape[0], shape[1] // cp.size, *shape[2:])
                local = torch.empty(local_shape, dtype=dtype, device=device)
                parts = None
                if leaf is not None:
                    positions = (zigzag_positions(shape[1], cp.size, r, device) for r in range(cp.size))
                    parts = [leaf.index_select(1, p).contiguous() for p in positions]
                dist.scatter(local, parts, group=cp.group, src=_global(cp, owner))
            else:
                local = leaf.clone() if leaf is not None else torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(local, group=cp.group, src=_global(cp, owner))
            outputs.append(local)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        cp, owner, whole = ctx.cp, ctx.owner, []
        for (kind, shape, dtype), grad in zip(ctx.spec, grads):
            if grad is None:  # an output autograd does not differentiate (an integer tensor)
                local = (shape[0], shape[1] // cp.size, *shape[2:]) if kind == "seq" else shape
                grad = torch.zeros(local, dtype=dtype, device=ctx.inputs[0][2])
            grad = grad.contiguous()
            if kind == "seq":
                parts = [torch.empty_like(grad) for _ in range(cp.size)] if cp.rank == owner else None
                dist.gather(grad, parts, group=cp.group, dst=_global(cp, owner))
                if parts is not None:
                    joined = torch.cat(parts, dim=1)
                    whole.append(joined.index_select(1, gathered_to_global(shape[1], cp.size, grad.device)))
            else:
                grad = grad.clone()
                dist.reduce(grad, group=cp.group, dst=_global(cp, owner))
                whole.append(grad)
        if cp.rank != owner:  # the stand-ins: zero gradients, so that the module's parameters get zeros
            whole = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs]
        return None, None, None, *whole


def leaves(output) -> list[torch.Tensor]:
    """The tensors of ``output`` (any nesting), in order."""
    found: list[torch.Tensor] = []
    apply_to_collection(output, torch.Tensor, found.append)
    return found


def replaced(output, tensors: list[torch.Tensor]):
    """``output`` with its tensors replaced by ``tensors``, in order."""
    supply = iter(tensors)
    return apply_to_collection(output, torch.Tensor, lambda _: next(supply))


def to_owner(shards: list[torch.Tensor], cp: CPGroup, owner: int) -> list[torch.Tensor]:
    """Whole sequences of ``shards`` (batch, seq / C, ...) on ``owner``; empty stand-ins elsewhere.

    Example::

        whole = to_owner([hidden_local], cp, owner=1)   # rank 1: [(batch, seq, dim)]; others: [tensor([])]
    """
    return list(_ToOwner.apply(cp, owner, *map(plain, shards)))


def from_owner(
    output, length: int, cp: CPGroup, owner: int, stand_ins: list[torch.Tensor], specs: dict | None = None, key=None
):
    """The owner's ``output`` on every rank: each leaf of the whole ``length`` as this rank's positions, others
    whole. Elsewhere ``output`` is the module's output on the stand-in (its structure), and ``stand_ins`` the
    tensors the backward's zero gradients go to. The owner sends the leaves' kinds, shapes and dtypes once per
    ``key`` (the same on every rank: what they follow from, the input's shape and dtype) and ``specs`` keeps them,
    so that a step does not pickle and broadcast them again (a host sync per call on GPUs).

    Example::

        out_local = from_owner(mixer(whole), seq_len, cp, owner, stand_ins=tokens)
    """
    own, spec = [plain(t) for t in leaves(output)], [None if specs is None else specs.get(key)]
    if spec[0] is None:
        if cp.rank == owner:
            spec = [[("seq" if t.dim() >= 2 and t.shape[1] == length else "whole", tuple(t.shape), t.dtype)
                     for t in own]]  # fmt: skip
        dist.broadcast_object_list(spec, group=cp.group, src=_global(cp, owner))
        if specs is not None:
            specs[key] = spec[0]
    if len(own) != len(spec[0]):
        raise RuntimeError(
            f"context parallelism runs a sequence mixer on rank {owner} for the whole sequence and on the others on "
            f"{STAND_IN_LENGTH} positions, and its output has {len(spec[0])} tensors on the first but {len(own)} on "
            f"rank {cp.rank}: its output's structure depends on the sequence length. Use a micro-batch divisible by "
            "the context-parallel size (each rank then runs it on whole sequences of its own rows)."
        )
    inputs = own if cp.rank == owner else [*stand_ins, *own]
    return replaced(output, list(_FromOwner.apply(cp, owner, spec[0], *inputs)))
