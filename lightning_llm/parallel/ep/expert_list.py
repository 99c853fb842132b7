"""Expert parallelism for a ``ModuleList`` of expert modules, called one expert at a time by the model's own loop.

Many MoE layers keep one module per expert in an ``nn.ModuleList`` and run ``expert(x[rows])`` for each expert in
turn (litgpt's ``LLaMAMoE``, Mistral's reference code, most hand-written MoE blocks). The loop and the router stay
the model's code; what changes is where each expert lives. EP rank ``r`` keeps experts ``[r * n / E, (r + 1) * n /
E)`` and every other entry of the list becomes a :class:`RemoteExpert` without parameters. Each call of expert
``i`` is an exchange over the EP group: every rank sends the rows it routed to ``i`` to ``i``'s owner (one
``all_to_all_single`` with variable splits), the owner runs the expert once on all of them, and a second all-to-all
brings every rank its rows' outputs (both autograd-aware, so gradients take the reverse trips).

Every rank must call every expert once per forward, in the list's order (a loop over all experts, even those that
got no row, as ``LLaMAMoE`` does): each call first exchanges a small header (which list, which expert, how many
rows), and the layer's forward ends with an end marker, so ranks calling different experts, or a different number
of them (a loop over only the experts hit), raise a clear error on every rank instead of hanging.

An owned expert's gradient sums every EP peer's rows; it is scaled by ``1 / E`` (the gradient reaching its output
is multiplied by ``1 / E``, the one leaving its input by ``E``, so the tokens' gradients are untouched) and the data
parallelism over ``edp`` completes the mean over all data-parallel ranks, as for stacked experts (:mod:`.style`).
Owned experts' parameters carry ``ep_owner_group``: the gradient norm adds them up over the EP group
(:mod:`lightning_llm.parallel.grad_norm`). The state dict keeps the model's names; each rank holds its own experts'
entries, which distributed checkpoints save and load by name across any E.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_llm._compat.torch_distributed import all_to_all_single
from lightning_llm.parallel.ep.style import scale_grad

END = -1  # the header's expert index at the end of a layer's forward


class RemoteExpert(nn.Module):
    """Stands in for an expert held by another EP rank: sends this rank's rows there and returns their outputs."""

    def __init__(self, exchange: _Exchange, index: int, elements: int) -> None:
        super().__init__()
        self.exchange, self.index = exchange, index
        self.elements_elsewhere = elements  # the expert's parameter elements, for shares of the whole (coverage)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            raise TypeError(
                f"expert {self.index} of {self.exchange.name!r} was called with more than its rows; expert "
                "parallelism over a ModuleList needs experts called as expert(rows)."
            )
        received = self.exchange.send(self.index, x)  # no rows arrive here; sent back as they are (0 rows)
        return self.exchange.receive(received)


class _Exchange:
    """The all-to-alls of one expert list: a call's rows go to the expert's owner and its outputs come back."""

    def __init__(self, name: str, uid: int, count: int, mesh: DeviceMesh) -> None:
        self.name, self.uid, self.mesh = name, uid, mesh
        self.ep, self.rank = mesh.size(), mesh.get_local_rank()
        self.local = count // self.ep
        self._calls: list[tuple[list[int], list[int], torch.Size]] = []  # pushed by send, popped by receive
        self._device = torch.device("cpu")  # the rows' device (NCCL exchanges device tensors only), for end()

    def owner(self, index: int) -> int:
        return index // self.local

    def _counts(self, index: int, rows: int) -> list[int]:
        """Every rank's row count for this call, after checking they all call the same expert of the same list."""
        mine = torch.tensor([self.uid, index, rows], dtype=torch.long, device=self._device)
        every = [torch.empty_like(mine) for _ in range(self.ep)]
        dist.all_gather(every, mine, group=self.mesh.get_group())
        every = torch.stack(every).tolist()  # one host read: the splits are host ints
        calls = {(h[0], h[1]) for h in every}
        if len(calls) > 1:
            raise RuntimeError(
                f"expert parallelism over the ModuleList {self.name!r}: the EP ranks called different experts "
                f"((list, expert) pairs, expert {END} = the layer's forward ended): {sorted(calls)}. Every rank must "
                "call every expert once per forward, in order, also those no row was routed to (a loop over only the "
                f"experts hit cannot be split this way). Keep it whole: expert_parallel_plan={{'{self.name}': "
                "'data_parallel'}."
            )
        return [h[2] for h in every]

    def send(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows to expert ``index``'s owner; returns the rows this rank received (all ranks' rows at
        the owner, in rank order; none elsewhere)."""
        self._device = x.device
        counts = self._counts(index, x.shape[0])
        owner = self.owner(index)
        to_owner = [x.shape[0] if r == owner else 0 for r in range(self.ep)]
        from_ranks = counts if self.rank == owner else [0] * self.ep
        self._calls.append((to_owner, from_ranks, x.shape))
        return all_to_all_single(x, from_ranks, to_owner, self.mesh)

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        """The outputs of the last :meth:`send`'s rows back to their ranks; returns this rank's rows' outputs."""
        to_owner, from_ranks, shape = self._calls.pop()
        if out.shape[1:] != shape[1:]:
            raise ValueError(
                f"an expert of {self.name!r} returned rows of shape {tuple(out.shape[1:])} for rows of shape "
                f"{tuple(shape[1:])}: expert parallelism over a ModuleList needs experts that keep the row's shape."
            )
        return all_to_all_single(out, to_owner, from_ranks, self.mesh)

    def end(self) -> None:
        self._counts(END, 0)


def split_expert_list(
    name: str, experts: nn.ModuleList, parent: nn.Module, mesh: DeviceMesh, uid: int
) -> list[nn.Module]:
    """Keep this EP rank's experts of ``experts`` and replace the others by :class:`RemoteExpert` (in place);
    returns the experts kept (their data parallelism is applied by the caller). ``parent`` is the module whose
    forward calls them (its end is checked on every rank); ``uid`` tells this list from the others in checks.

    Example::

        kept = split_expert_list("model.layers.0.mlp.experts", layer.mlp.experts, layer.mlp, ep_mesh, uid=0)
    """
    exchange = _Exchange(name, uid, len(experts), mesh)
    kept = []
    for index in range(len(experts)):
        if exchange.owner(index) != exchange.rank:
            experts[index] = RemoteExpert(exchange, index, sum(p.numel() for p in experts[index].parameters()))
            continue
        expert = experts[index]
        expert.ep_owner_group = mesh.get_group()  # set on its parameters after data parallelism wraps them
        expert.register_forward_pre_hook(lambda m, args, i=index: _enter(exchange, i, args))
        expert.register_forward_hook(lambda m, args, out: exchange.receive(scale_grad(out, 1.0 / exchange.ep)))
        kept.append(expert)
    parent.register_forward_hook(lambda module, args, output: (exchange.end(), output)[1])
    return kept


def _enter(exchange: _Exchange, index: int, args: tuple) -> tuple:
    if len(args) != 1:
        raise TypeError(
            f"expert {index} of {exchange.name!r} was called with {len(args)} positional arguments; expert "
            "parallelism over a ModuleList needs experts called as expert(rows)."
        )
    received = exchange.send(index, args[0])
    return (scale_grad(received, float(exchange.ep)),)
