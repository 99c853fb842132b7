"""Sharded weights lent to a module as local tensors for one call, and put back after it.

Some modules use their weights in ways a DTensor cannot take: an experts module indexes them by local expert id,
an attention module adds a per-head parameter to plain local activations. Their weights stay DTensors for everything
outside the forward (checkpoints, optimizer, FSDP2, clipping); a forward pre-hook lends the module the local shards
for the call and the forward hook puts the DTensors back, the way FSDP2 lends unsharded parameters (and Hugging
Face's ``_use_local_dtensor_params``). Tensor parallelism's experts (:mod:`.tp.experts`), the per-head parameters of
split attention (:mod:`.tp.attention_heads`) and expert parallelism (:mod:`.ep.style`) all lend through here.

Calls nest: a module may be called again before its call returns, and activation checkpointing re-runs the forward
inside backward. Each :func:`lend` returns a :class:`Loan` that only its own :func:`restore` settles; a call made
while the weights are already lent takes nothing and computes with the same local tensors, so restoring loans in
reverse order (a stack per module, held by the hook's owner, never on the module) always ends with the DTensors back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm._compat.torch import module_parameters


class Loan(NamedTuple):
    """One call's loan: the DTensor parameters it took from ``module`` and the tensors the call computes with."""

    module: nn.Module
    taken: dict[str, DTensor]
    local: list[torch.Tensor]


def lend(module: nn.Module, names: Sequence[str], wrap: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Loan:
    """Put each DTensor parameter of ``module`` named in ``names`` as its local tensor (``wrap``-ped) in its slot.

    Slots are read at call time: FSDP2 may have swapped in its unsharded parameter (still a DTensor on the tp or EP
    mesh). A slot already holding a plain tensor (an outer call lent it) is left as it is.

    Example::

        loan = lend(experts, ["gate_up_proj", "down_proj"])
        try:
            out = experts(rows, ids, weights)
        finally:
            restore(loan)
    """
    slots = module_parameters(module)
    taken = {name: slots[name] for name in names if isinstance(slots[name], DTensor)}
    for name, param in taken.items():
        slots[name] = param.to_local() if wrap is None else wrap(param.to_local())
    return Loan(module, taken, [slots[name] for name in names if slots[name] is not None])


def restore(loan: Loan) -> None:
    """Put back the DTensor parameters ``loan`` took."""
    module_parameters(loan.module).update(loan.taken)


def lend_during_calls(module: nn.Module, names: Sequence[str]) -> None:
    """For every call of ``module``, lend it the local tensors of its DTensor parameters ``names``.

    Example::

        lend_during_calls(attention, ["sinks"])  # the per-head sinks are this rank's heads' rows inside the call
    """
    loans: list[Loan] = []  # one per call in flight
    module.register_forward_pre_hook(lambda m, args: loans.append(lend(m, names)))
    module.register_forward_hook(lambda m, args, output: _settle_last(loans), always_call=True)


def _settle_last(loans: list[Loan]) -> None:
    """Restore the newest loan (none when the pre-hook itself raised); ``None``: the output is left as it is."""
    if loans:
        restore(loans.pop())
