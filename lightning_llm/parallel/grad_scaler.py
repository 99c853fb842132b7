"""fp16 loss scaling for a parallelized model: plain and DTensor gradients unscaled alike, every rank skips together.

torch's ``GradScaler`` unscales with one foreach kernel per device and dtype, which refuses a list that mixes plain
tensors and DTensors (a tensor-parallel model's replicated norms beside its sharded projections), and it looks for
inf/NaN only in this rank's gradients. Under tensor, pipeline or sharded data parallelism a rank holds only some
shards and stages, so an overflow one rank finds must skip the step on all of them, or the replicas drift apart.
:class:`DistributedGradScaler` unscales each gradient's local shard (the same elements, in place) and takes the
maximum of the found-inf flag over the process group, as FSDP1's ``ShardedGradScaler`` does for its flat shards.

A scaler the user made stays theirs: :func:`distributed_in_place` gives that object this behavior (its class becomes
:class:`DistributedGradScaler`, or a subclass of the user's own class), so ``scaler.get_scale()`` in a callback is the
run's scale and its ``state_dict`` is what the checkpoint holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_llm.parallel.dtensor import local_grad_stand_in


class DistributedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose inf/NaN check covers every rank of ``group`` (default: all ranks).

    Example::

        scaler = DistributedGradScaler.like(torch.amp.GradScaler("cuda"), "cuda")
        MixedPrecision("16-mixed", "cuda", scaler=scaler)
    """

    def __init__(self, device: str = "cuda", *, group: dist.ProcessGroup | None = None, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, device: str, group: dist.ProcessGroup | None = None):
        """A distributed scaler with ``scaler``'s settings and state (its current scale and growth tracker)."""
        ours = cls(
            device,
            group=group,
            init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )
        if scaler.is_enabled():
            ours.load_state_dict(scaler.state_dict())
        return ours

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # The one override: torch's own unscaling, run on each gradient's local shard, then the flag agreed on.
        per_device = super()._unscale_grads_(_LocalShards(optimizer), inv_scale, found_inf, allow_fp16)
        if not (dist.is_available() and dist.is_initialized()):
            return per_device
        flag = found_inf.new_zeros(())
        for value in per_device.values():
            flag += value.to(flag.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # every rank, every step: one collective
        return {device: flag.to(device) for device in per_device} or {flag.device: flag}


def distributed_in_place(scaler: torch.amp.GradScaler, group: dist.ProcessGroup | None = None) -> torch.amp.GradScaler:
    """``scaler`` itself, made a :class:`DistributedGradScaler` (same object, state and settings; a subclass of the
    user's class where it is not torch's own), so the object the user holds is the one that scales the run.

    A copy would train right but leave the user's scaler at its initial scale while the run's changes (a callback
    logging it would report a value that is not true). Outside a process group the added check is a no-op.

    Example::

        scaler = torch.amp.GradScaler("cuda")
        distributed_in_place(scaler) is scaler  # True; isinstance(scaler, DistributedGradScaler) too
    """
    if not isinstance(scaler, DistributedGradScaler):
        cls = type(scaler)
        scaler.__class__ = DistributedGradScaler if cls is torch.amp.GradScaler else _distributed_subclass(cls)
    scaler.group = group
    return scaler


_SUBCLASSES: dict[type, type] = {}


def _distributed_subclass(cls: type) -> type:
    """``Distributed<cls>``: the user's scaler class with :class:`DistributedGradScaler`'s unscale first."""
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Distributed{cls.__name__}", (DistributedGradScaler, cls), {"__module__": __name__})
    return _SUBCLASSES[cls]


class _LocalShards:
    """An optimizer's parameter groups as seen by ``GradScaler``: each parameter's local shard and gradient.

    The stand-in parameters alias the local tensors (``detach`` shares storage), so unscaling them in place
    unscales the real gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = [
            {"params": [local_grad_stand_in(p.grad) for p in group["params"] if p.grad is not None]}
            for group in optimizer.param_groups
        ]
