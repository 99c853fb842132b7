"""Muon that orthogonalizes each matrix once per step, on one rank, whatever the matrix's DTensor layout.

``torch.optim.Muon`` runs its Newton-Schulz iteration on whatever tensor it is handed. Under FSDP2 or tensor
parallelism that is a DTensor, so every rank of the parameter's mesh gathers the matrix and repeats the same
matmuls: N ranks, N times the work. Here each matrix's update is gathered (one all-gather, DTensor's own
``full_tensor``), orthogonalized by one rank of its mesh (matrices spread over the ranks by their cost), and handed
back as shards (one reduce-scatter of the owner's result, ``Partial`` -> the parameter's placements). The momentum,
weight decay and update stay on each rank's shard, as in torch's Muon, so the result is the one-process result.

Lightning's automatic optimization takes one optimizer, and Muon is meant for hidden matrices only (embeddings,
the output head, norms and biases take AdamW), so param groups with ``use_muon=False`` are stepped by AdamW here
(Keller Jordan's ``MuonWithAuxAdam`` design); :func:`muon_param_groups` makes that split for any model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial

# Keller Jordan's quintic coefficients, as torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Muon's orthogonalization of a 2-D ``matrix``, computed in ``dtype`` (torch.optim.Muon's: bfloat16).

    The same iteration as torch's; ``dtype=torch.float32`` removes bfloat16's rounding, which parity tests need.

    Example::

        update = newton_schulz(torch.randn(64, 32), dtype=torch.float32)  # singular values near 1
    """
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-shape learning rate: ``"original"`` (Keller Jordan) or ``"match_rms_adamw"`` (Moonshot)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def _cost(matrix: torch.Tensor) -> int:
    rows, cols = matrix.shape
    return rows * cols * min(rows, cols)


def _mesh_key(tensor: DTensor) -> tuple[int, ...]:
    return tuple(tensor.device_mesh.mesh.flatten().tolist())


def assign_owners(updates: list[torch.Tensor]) -> list[int | None]:
    """The global rank that orthogonalizes each DTensor update (``None``: a plain tensor, done where it lives).

    Per mesh, the costliest matrix goes first to the least loaded rank; every rank computes the same answer from
    the shapes alone, so no agreement is needed.
    """
    owners: list[int | None] = [None] * len(updates)
    loads: dict[tuple[int, ...], list[int]] = {}
    order = sorted(range(len(updates)), key=lambda i: -_cost(updates[i]))
    for i in order:
        if isinstance(updates[i], DTensor):
            ranks = _mesh_key(updates[i])
            load = loads.setdefault(ranks, [0] * len(ranks))
            slot = load.index(min(load))
            load[slot] += _cost(updates[i])
            owners[i] = ranks[slot]
    return owners


class ShardedMuon(torch.optim.Optimizer):
    """Muon for any layout of LLMParallelStrategy: Newton-Schulz once per matrix per step, exact to one process.

    Arguments and state (``momentum_buffer``) are torch.optim.Muon's; ``ns_dtype`` picks the iteration's precision.
    Groups with ``use_muon=False`` (the keyword sets the default) are stepped by AdamW with the group's ``lr``,
    ``betas``, ``adamw_eps`` and ``weight_decay`` (torch.optim.AdamW's update, unfused).

    Example::

        def configure_optimizers(self):
            return ShardedMuon(muon_param_groups(self, adamw_lr=3e-4), lr=0.02)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        use_muon: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"ShardedMuon: {name}={value!r} must be >= 0.")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"ShardedMuon: adjust_lr_fn={adjust_lr_fn!r}; use None, 'original' or 'match_rms_adamw'.")
        if ns_steps >= 100:
            raise ValueError(f"ShardedMuon: ns_steps={ns_steps} must be below 100 (torch.optim.Muon's limit).")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            use_muon=use_muon,
            betas=tuple(betas),
            adamw_eps=adamw_eps,
        )
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if group["use_muon"] and p.ndim != 2]
            if bad:
                raise ValueError(
                    f"ShardedMuon: Muon groups take 2-D matrices only, got shapes {bad}. Put other parameters in a "
                    "group with use_muon=False (AdamW), e.g. with lightning_llm.optim.muon_param_groups(model)."
                )

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every group (``closure`` re-evaluates the loss, as in torch's optimizers)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon(group, params)
            else:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        updates = []
        for p in params:
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
            buf.lerp_(p.grad, 1 - group["momentum"])
            updates.append(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
        for p, update in zip(params, self._orthogonalize(updates, group)):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))

    def _orthogonalize(self, updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        def ns(matrix: torch.Tensor) -> torch.Tensor:
            return newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

        results = []
        for update, owner in zip(updates, assign_owners(updates)):
            if owner is None:
                results.append(ns(update))
                continue
            full = update.full_tensor()
            mine = ns(full).to(full.dtype) if dist.get_rank() == owner else torch.zeros_like(full)
            # The owner's result plus zeros from every other rank, reduce-scattered to the parameter's layout.
            summed = DTensor.from_local(
                mine, update.device_mesh, [Partial()] * update.device_mesh.ndim, run_check=False
            )
            results.append(summed.redistribute(update.device_mesh, update.placements))
        return results

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["adamw_eps"])
            p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))


def _config_vocab_sizes(model: nn.Module) -> set[int]:
    sizes = (getattr(getattr(m, "config", None), "vocab_size", None) for m in model.modules())
    return {size for size in sizes if isinstance(size, int)}


def muon_param_groups(
    model: nn.Module, *, adamw_lr: float = 3e-4, adamw_weight_decay: float = 0.0, **adamw: Any
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters for :class:`ShardedMuon`: hidden matrices to Muon, the rest to AdamW.

    AdamW gets every parameter that is not 2-D, the weights of ``nn.Embedding`` modules and any matrix with as many
    rows as the vocabulary (the output head, tied or not), as Muon's authors advise. The vocabulary is the rows of
    any embedding and any ``config.vocab_size`` of a submodule (Hugging Face's, the reference model's), so a pipeline
    stage that holds the head but not the embedding splits the same way.

    Example::

        optimizer = ShardedMuon(muon_param_groups(model, adamw_lr=3e-4, betas=(0.9, 0.95)), lr=0.02)
    """
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab_rows = {m.num_embeddings for m in embeddings} | _config_vocab_sizes(model)
    embedding_ids = {id(m.weight) for m in embeddings}
    muon, other = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        hidden = p.ndim == 2 and id(p) not in embedding_ids and p.shape[0] not in vocab_rows
        (muon if hidden else other).append(p)
    groups = [{"params": muon, "use_muon": True}]
    if other:
        groups.append({"params": other, "use_muon": False, "lr": adamw_lr, "weight_decay": adamw_weight_decay, **adamw})
    return groups
