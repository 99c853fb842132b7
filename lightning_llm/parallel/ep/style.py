"""Expert parallelism as a torch ``ParallelStyle`` on a Hugging Face-style experts module.

The module keeps its own forward (eager loop, ``grouped_mm``, ``batched_mm``, biases, clamped activations): the
style only changes what it is called with. A forward pre-hook dispatches this rank's routes to the EP ranks owning
their experts (:mod:`.dispatch`) and calls the module on the rows it received, with local expert ids and unit
weights; a forward hook sends the outputs home, weights them by the router's scores and sums over top-k. So the
module sees only ids of experts it holds (no off-rank sentinel id, which GptOss's ``one_hot(num_classes=
num_experts)`` could not take), and the router's scores stay on the router's rank.

The expert weights are ``Shard(0)`` DTensors on the EP mesh for everything outside the forward (checkpoints,
optimizer, FSDP2, clipping); inside it the module indexes them by local expert id, which a DTensor cannot do, so the
pre-hook lends the module its local shards for the call and the forward hook puts the DTensors back
(:mod:`lightning_llm.parallel.lent_weights`, as :mod:`lightning_llm.parallel.tp.experts` does).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llm.parallel.ep.dispatch import combine, dispatch
from lightning_llm.parallel.lent_weights import lend, restore

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def routed_arguments(module: nn.Module) -> tuple[str, ...] | None:
    """The names of the forward's first three positional arguments (tokens, expert ids, router scores), or None.

    Hugging Face names them ``(hidden_states, top_k_index, top_k_weights)``, GptOss ``(hidden_states,
    router_indices, routing_weights)``; both pass them positionally.
    """
    params = [p for p in inspect.signature(module.forward).parameters.values() if p.kind in POSITIONAL]
    return tuple(p.name for p in params[:3]) if len(params) >= 3 else None


class ExpertParallel(ParallelStyle):
    """Give each EP rank ``num_experts / ep`` whole experts of a stacked-experts module; tokens move by all-to-all.

    The module must hold every expert weight itself with experts as the first dimension, keep an int
    ``num_experts`` and take ``forward(tokens, top_k_ids, top_k_scores)`` returning one ``(tokens, dim)`` tensor
    (see :func:`lightning_llm.parallel.ep.apply.check_experts`).

    Args:
        grad_scale: multiplies the local experts' weight gradients. Each holds the sum over the EP group's tokens;
            ``1 / ep`` makes a data-parallel mean over the remaining ranks the mean over every data-parallel rank.

    Example::

        parallelize_module(model, ep_mesh, {"model.layers.0.mlp.experts": ExpertParallel()})
    """

    def __init__(self, *, grad_scale: float = 1.0) -> None:
        super().__init__()
        self.grad_scale = grad_scale

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        calls = _ExpertCalls(module, device_mesh, self.grad_scale)
        distribute_module(module, device_mesh, partition_fn=_shard_by_expert)
        module.num_experts = calls.total // device_mesh.size()  # the module's own code now counts its local experts
        module.register_forward_pre_hook(calls.enter, with_kwargs=True)
        module.register_forward_hook(lambda m, args, output: calls.exit(output), always_call=True)
        return module


def _shard_by_expert(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if name:  # distribute_module visits submodules too; the experts' weights are the module's own
        return
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


class _ExpertCalls:
    """One experts module's calls under expert parallelism: routes dispatched in, outputs combined back out.

    Holds, per call in flight (activation checkpointing re-enters the forward inside backward), what the forward
    hook needs to send the outputs home and the loan of the module's local weights.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh, scale: float) -> None:
        self.routed = routed_arguments(module)
        self.signature = inspect.signature(module.forward)
        self.names = [name for name, _ in module.named_parameters(recurse=False)]
        self.mesh, self.total, self.scale = mesh, module.num_experts, scale
        self.calls: list[tuple] = []

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Dispatch this rank's routes to the ranks holding their experts; the local weights lent for the call."""
        bound = self.signature.bind(*args, **kwargs)
        hidden, index, weights = (bound.arguments[n] for n in self.routed)
        rows, local_ids, routing = dispatch(hidden, index, self.mesh, self.total)
        bound.arguments[self.routed[0]] = rows
        bound.arguments[self.routed[1]] = local_ids.unsqueeze(-1)
        # Unit weights: the module's own weighting becomes an exact no-op; combine() applies the router's scores.
        bound.arguments[self.routed[2]] = torch.ones((rows.shape[0], 1), dtype=weights.dtype, device=weights.device)
        scale = self.scale
        loan = lend(module, self.names, None if scale == 1.0 else lambda local: scale_grad(local, scale))
        self.calls.append((routing, weights, hidden.dtype, rows, loan))
        return bound.args, bound.kwargs

    def exit(self, output: torch.Tensor | None) -> torch.Tensor | None:
        """Send the outputs home and weight them by the router's scores; the lent weights put back."""
        if not self.calls:  # the pre-hook itself raised: nothing was lent or dispatched
            return output
        routing, weights, dtype, rows, loan = self.calls.pop()
        restore(loan)
        if output is None:  # the forward raised; the hook only restores the parameters
            return None
        if not isinstance(output, torch.Tensor):
            raise TypeError(
                f"expert parallelism expects the experts module to return one tensor, got {type(output).__name__}."
            )
        if rows.shape[0] == 0:
            # No route reached this rank's experts: tie the (empty) output to the received rows and the local
            # weights, so backward still runs this rank's half of both all-to-alls and the weights get a zero
            # gradient, as the single process gives experts no token reached.
            output = output + sum((p.sum() * 0 for p in loan.local), rows.sum() * 0)
        return combine(output, weights, routing, self.mesh, dtype)


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged in forward; its gradient multiplied by ``scale`` in backward.

    Example::

        local = scale_grad(weight_shard, 1 / ep)  # the shard's gradient sums ep ranks' tokens: make it their mean
    """
    return _ScaleGrad.apply(x, scale)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
