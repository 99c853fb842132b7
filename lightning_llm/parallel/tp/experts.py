"""Mixture-of-experts layers under tensor parallelism: whole experts per tp rank, tokens never move.

Hugging Face MoE models (Mixtral, Qwen3-MoE, OLMoE, ...) keep all experts of a layer in one module
with 3-D weights (``gate_up_proj``: experts x 2I x D, ``down_proj``: experts x D x I) that their
forward indexes by expert id. Inside a tensor-parallel block every rank holds the same tokens, so
the cheapest exact split is by expert (``Shard(0)`` of every expert weight, a contiguous block of
experts per rank): each rank runs its own experts on the routes that reach them and one all-reduce
sums the partial outputs, the same communication as a row-wise layer. This is Hugging Face's
``AllReduceEP`` (``transformers.distributed.expert_parallel``) expressed as a torch ``ParallelStyle``.

Why the pieces:

- The weights stay ``Shard(0)`` DTensors for everything outside the forward (checkpoints, optimizer,
  exact initialization, pretrained loading, export, clipping), so a checkpoint keeps the model's own
  layout. Inside the forward the experts code indexes the weights with local expert ids, which a
  DTensor cannot do, so the module is lent its local shards for the duration of the call
  (:mod:`lightning_llm.parallel.lent_weights`).
- Only the routes to this rank's experts reach the module, one row per route (token, expert) with the local
  expert id, the way expert parallelism's dispatch hands them over without the all-to-all; the rows are added
  back onto their tokens after. The module never sees an expert it does not hold, so no transformers release's
  handling of an off-rank sentinel id is relied on.
- Llama 4's experts take the tokens repeated once per expert, expert-major, already scaled by the router's
  scores, and the MoE block sums their output over experts: each rank runs its experts' blocks of rows, sums
  them per token, and the all-reduced sum comes back in the first expert's rows (zeros in the others), so the
  block's own reshape-and-sum gives the total.
- The shared inputs (tokens, routing weights) get their gradient summed over the tp group: each rank
  backpropagates through its own experts only. The router before them therefore sees the full
  gradient on every rank and stays replicated without any gradient correction.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_llm.modeling.experts import expert_count
from lightning_llm.parallel.lent_weights import lend, restore

INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def check_experts(name: str, module: nn.Module, tp: int) -> None:
    """Refuse, before training, an experts module this style cannot split exactly.

    Example::

        check_experts("model.layers.0.mlp.experts", experts, tp=2)
    """
    count = expert_count(module)
    if count is None:
        raise ValueError(
            f"{name!r} is given 'experts', which needs a module with an int `num_experts` whose parameters are all its "
            "own (none in submodules) with `num_experts` as their first dimension (Hugging Face's MoE experts). "
            "Keep it whole instead: "
            f"tensor_parallel_plan={{'{name}': 'replicate', ...}}."
        )
    if count % tp:
        raise ValueError(
            f"{name!r} has {count} experts, not divisible by tensor_parallel_size={tp}: 'experts' gives each tp rank "
            f"whole experts. Use a tensor_parallel_size that divides {count}."
        )
    missing = [n for n in INPUTS if n not in inspect.signature(module.forward).parameters]
    if missing and not takes_expert_rows(module):  # GptOss's forward(hidden, router_indices=None, ...) is neither
        raise ValueError(
            f"{name!r}'s forward has no argument(s) {missing}; 'experts' expects Hugging Face's experts call "
            "forward(hidden_states, top_k_index, top_k_weights), or forward(hidden_states) on the tokens repeated once "
            f"per expert (Llama 4). Keep it whole: tensor_parallel_plan={{'{name}': 'replicate', ...}}."
        )


def takes_expert_rows(module: nn.Module) -> bool:
    """Whether the experts' forward takes one tensor and nothing else: the tokens repeated once per expert,
    expert-major (Llama 4's ``experts(routed_in)``, each block of rows already scaled by its expert's routing
    score), returning one row per input row, which the MoE block sums over the experts. A forward with any other
    argument, even an optional one (GptOss's ``router_indices=None``), routes tokens some other way."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    return len(parameters) == 1 and parameters[0].kind in (
        parameters[0].POSITIONAL_ONLY,
        parameters[0].POSITIONAL_OR_KEYWORD,
    )


class ExpertsParallel(ParallelStyle):
    """Split an experts module by expert over the tp group; inputs and output stay whole on every rank.

    Example::

        parallelize_module(model, tp_mesh, {"model.layers.*.mlp.experts": ExpertsParallel()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, count = device_mesh.size(), expert_count(module)
        distribute_module(module, device_mesh, partition_fn=_shard_experts)
        module.num_experts = count // tp
        calls = _ExpertCalls(module, device_mesh)
        if takes_expert_rows(module):
            module.register_forward_pre_hook(calls.enter_rows)
            module.register_forward_hook(lambda m, args, output: calls.exit_rows(output), always_call=True)
        else:
            module.register_forward_pre_hook(calls.enter, with_kwargs=True)
            module.register_forward_hook(lambda m, args, output: calls.exit(output), always_call=True)
        return module


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if name:  # distribute_module visits submodules too; expert_count allows parameters on the module alone
        return
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


class _ExpertCalls:
    """One experts module's calls under tensor parallelism: this rank's routes (or rows) in, the sum over tp out.

    Holds, per call in flight (activation checkpointing re-enters the forward inside backward), where the rows go
    back and the loan of the module's local weights.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.mesh, self.tp, self.local = mesh, mesh.size(), module.num_experts
        self.first = mesh.get_local_rank() * self.local
        self.signature = inspect.signature(module.forward)
        self.names = [name for name, _ in module.named_parameters(recurse=False)]
        self.calls: list[tuple] = []

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """This rank's routes in, one row each with its local expert id; the local weights lent for the call."""
        bound = self.signature.bind(*args, **kwargs)
        hidden, index, weights = (bound.arguments[n] for n in INPUTS)
        first, mesh = self.first, self.mesh
        # Only this rank's routes go in, one row each with its local expert id: the module never sees an expert it
        # does not hold (no sentinel id, which each transformers release handles differently) and does 1/tp of the work.
        tokens, slots = ((index >= first) & (index < first + self.local)).nonzero(as_tuple=True)
        bound.arguments["top_k_index"] = (index[tokens, slots] - first)[:, None]
        # The shared inputs' gradients, partial on each rank (its own routes), are summed over the tp group.
        bound.arguments["top_k_weights"] = sum_grad(weights, mesh)[tokens, slots][:, None]
        bound.arguments["hidden_states"] = sum_grad(hidden, mesh)[tokens]
        self.calls.append(((tokens, hidden.shape[0]), lend(module, self.names)))
        return bound.args, bound.kwargs

    def enter_rows(self, module: nn.Module, args: tuple) -> tuple:
        """Expert-major rows, one block of tokens per expert: this rank's experts' blocks go in."""
        rows, experts = sum_grad(args[0], self.mesh), self.local * self.tp
        if rows.shape[0] % experts:
            raise RuntimeError(
                f"Tensor parallelism: {type(module).__name__} takes one tensor of {rows.shape[0]} rows, not one block "
                f"of tokens per expert ({experts} experts), so its rows cannot be split by expert. Keep it whole: "
                "tensor_parallel_plan={'<its name>': 'replicate', ...}."
            )
        self.calls.append(((rows.shape[0] // experts, rows.shape[0]), lend(module, self.names)))
        mine = rows.unflatten(0, (experts, -1))[self.first : self.first + self.local]
        return (mine.flatten(0, 1), *args[1:])

    def exit(self, output: torch.Tensor | None) -> torch.Tensor | None:
        """Each route's row back onto its token, summed over tp; the lent weights put back."""
        routes = self._finish()
        if routes is None or output is None:  # the pre-hook or the forward raised
            return output
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"'experts' expects the experts module to return one tensor, got {type(output).__name__}.")
        tokens, count = routes
        # A token's routes to this rank's experts add up; then the sum over tp.
        per_token = output.new_zeros(count, *output.shape[1:]).index_add(0, tokens, output)
        return _sum(per_token, self.mesh)

    def exit_rows(self, output: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's experts summed per token, then over tp, in the first expert's rows; the weights put back."""
        routes = self._finish()
        if routes is None or output is None:  # the pre-hook or the forward raised
            return output
        tokens, count = routes
        # The MoE block's sum over experts sees the total in the first expert's rows and zeros in the others, so
        # its own reshape-and-sum gives the total.
        summed = _sum(output.unflatten(0, (-1, tokens)).sum(0), self.mesh)
        return torch.cat([summed, summed.new_zeros(count - tokens, *summed.shape[1:])])

    def _finish(self) -> tuple | None:
        """The newest call's routes, its loan settled (``None`` when its pre-hook raised before lending)."""
        if not self.calls:
            return None
        routes, loan = self.calls.pop()
        restore(loan)
        return routes


def sum_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the gradient, partial on each rank, is summed over the tp group."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _sum(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum over the tp group (each rank's output covers its own experts); identity backward."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
