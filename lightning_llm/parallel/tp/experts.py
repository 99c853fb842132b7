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
  DTensor cannot do, so a forward pre-hook lends the module its local shards for the duration of the
  call, the way FSDP2 lends unsharded parameters (and Hugging Face's ``_use_local_dtensor_params``).
- Routes to experts on other ranks get the local id ``num_local_experts`` and weight 0: Hugging
  Face's experts implementations (eager, ``grouped_mm``, ``batched_mm``) skip that id when
  ``_is_expert_parallel`` is set.
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

from lightning_llm._compat.torch import module_parameters
from lightning_llm._compat.transformers import mark_expert_parallel

INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def expert_count(module: nn.Module) -> int | None:
    """The number of experts of an experts module (``num_experts`` with 3-D weights), else ``None``.

    Every parameter must be the module's own with the experts as its first dimension: a submodule's
    parameters (a shared norm, an identity expert) would otherwise be split by a dimension that is not experts.
    """
    count = getattr(module, "num_experts", None)
    weights = list(module.parameters(recurse=False))
    if not isinstance(count, int) or not weights or len(list(module.parameters())) != len(weights):
        return None
    # At least one 3-D weight: a router also holds ``num_experts`` and an (experts x dim) weight.
    experts_first = all(p.dim() >= 2 and p.shape[0] == count for p in weights)
    return count if experts_first and any(p.dim() >= 3 for p in weights) else None


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
    if missing:
        raise ValueError(
            f"{name!r}'s forward has no argument(s) {missing}; 'experts' expects Hugging Face's experts call "
            f"forward(hidden_states, top_k_index, top_k_weights). Keep it whole: tensor_parallel_plan={{'{name}': 'replicate', ...}}."
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
        mark_expert_parallel(module)  # Hugging Face's experts skip the off-rank id only when this is set
        first = device_mesh.get_local_rank() * module.num_experts
        signature = inspect.signature(module.forward)
        module.register_forward_pre_hook(
            lambda m, args, kwargs: _enter(m, signature, args, kwargs, device_mesh, first), with_kwargs=True
        )
        module.register_forward_hook(lambda m, args, output: _exit(m, output, device_mesh), always_call=True)
        return module


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if name:  # distribute_module visits submodules too; expert_count allows parameters on the module alone
        return
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


def _enter(module, signature, args, kwargs, mesh, first):
    bound = signature.bind(*args, **kwargs)
    hidden, index, weights = (bound.arguments[n] for n in INPUTS)
    local = module.num_experts
    off_rank = (index < first) | (index >= first + local)
    bound.arguments["top_k_index"] = torch.where(off_rank, local, index - first)
    # Summed before masking: the mask zeroes this rank's gradient for the routes other ranks compute.
    bound.arguments["top_k_weights"] = _sum_grad(weights, mesh).masked_fill(off_rank, 0.0)
    bound.arguments["hidden_states"] = _sum_grad(hidden, mesh)
    module._lent = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    for name, param in module._lent.items():
        module_parameters(module)[name] = param.to_local()  # lent for this call; the hook below puts the DTensor back
    return bound.args, bound.kwargs


def _exit(module, output, mesh):
    for name, param in getattr(module, "_lent", {}).items():
        module_parameters(module)[name] = param
    module._lent = {}
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"'experts' expects the experts module to return one tensor, got {type(output).__name__}.")
    return _sum(output, mesh)


def _sum_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the gradient, partial on each rank, is summed over the tp group."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _sum(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum over the tp group (each rank's output covers its own experts); identity backward."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
