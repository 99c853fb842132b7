"""MoEMonitor: how evenly each mixture-of-experts layer spreads its tokens over its experts, and the router's loss.

A router that sends most tokens to a few experts wastes the others (and, under expert parallelism, idles their
ranks); one that starves an expert for good has lost it. The monitor counts, per MoE layer, the routes each expert
received since the last log, on the device (a ``bincount`` per forward, no host sync), and on the Trainer's logging
steps logs, per layer and over all layers:

- ``moe/<layer>/max_load`` and ``moe/max_load``: the busiest expert's routes over the mean (1.0 is perfect balance;
  ``num_experts / top_k`` means one expert took every route);
- ``moe/<layer>/empty_experts`` and ``moe/empty_experts``: the fraction of experts that got no route;
- ``moe/aux_loss``: the sum of the load-balancing losses the MoE layers keep as ``aux_loss`` (the reference
  model's), when any does.

With a ``WandbLogger``, each layer's load per expert (its routes over the mean) is also logged as a W&B histogram,
``moe/<layer>/expert_load``, one bin per expert, from the same host read.

Counts are averaged over all ranks first (one all-reduce and one host read per logging step), so the figures are
the global batch's: each data-parallel rank routes its own tokens; tensor-parallel ranks count the same routes.
Both statistics are ratios, so a recompute under activation checkpointing (which routes the same tokens again)
leaves them unchanged. MoE layers are found by structure, as expert parallelism finds them; their routes are read
at the experts module's input, before expert parallelism's dispatch.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_llm.callbacks import cadence
from lightning_llm.contract import contract_of
from lightning_llm.parallel.ep.style import routed_arguments
from lightning_llm.validation import check_int


def moe_layers(module: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """Each experts module of ``module`` and its total number of experts, also once split by expert or tensor
    parallelism (which set ``num_experts`` to the local count; the stacked weights keep the global one)."""
    layers = {}
    for name, m in module.named_modules():
        weights = list(m.parameters(recurse=False))
        stacked = isinstance(getattr(m, "num_experts", None), int) and any(w.dim() >= 3 for w in weights)
        if stacked and routed_arguments(m) is not None:
            layers[name] = (m, weights[0].shape[0])
    return layers


class MoEMonitor(L.Callback):
    """Logs each MoE layer's expert load (busiest expert over the mean, fraction of idle experts) and aux loss.

    Arguments:
        log_every_n_steps: optimizer steps between logs; default the Trainer's ``log_every_n_steps``.

    Example::

        trainer = L.Trainer(callbacks=[MoEMonitor()], log_every_n_steps=10)
        # logs moe/max_load, moe/empty_experts, moe/model.layers.1.feed_forward.experts/max_load, ...
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, minimum=1)
        self.log_every_n_steps = log_every_n_steps
        self._layers: dict[str, torch.Tensor] = {}
        self._aux_modules: list[nn.Module] = []
        self._handles: list = []
        self._last_step = -1
        self.expert_loads: dict[str, list[float]] = {}  # per layer, each expert's routes over the mean, last log

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cadence.check_multiple(trainer, self.log_every_n_steps, "MoEMonitor")
        layers = moe_layers(pl_module)
        if not layers:
            rank_zero_warn("MoEMonitor: the model has no mixture-of-experts layer it can read; it logs nothing.")
        if layers and contract_of(trainer).layout.pp > 1:
            rank_zero_warn("MoEMonitor under pipeline parallelism reports the MoE layers of rank 0's stages only.")
        device = trainer.strategy.root_device
        for name, (experts, count) in layers.items():
            self._layers[name] = torch.zeros(count, device=device)
            # Prepended: expert parallelism's own pre-hook replaces the expert ids by this rank's local ones.
            hook = self._counter(self._layers[name])
            self._handles.append(experts.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
        self._aux_modules = [m for m in pl_module.modules() if hasattr(m, "aux_loss")]

    @staticmethod
    def _counter(counts: torch.Tensor):
        def count(module, args, kwargs):
            if module.training:  # training forwards only; evaluation routes do not train the router
                ids = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
                counts.add_(torch.bincount(ids.flatten().to(counts.device), minlength=counts.numel())[: counts.numel()])

        return count

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not self._layers or self._last_step == trainer.global_step:
            return
        if not cadence.due(trainer, self.log_every_n_steps, counted=True):
            return
        self._last_step = trainer.global_step
        for name, value in self.metrics(trainer).items():
            pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)
        self._log_histograms(trainer)

    def _log_histograms(self, trainer: L.Trainer) -> None:
        """Each layer's per-expert load as a W&B histogram (one bin per expert), on rank 0 of a W&B run."""
        loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if not loggers or trainer.global_rank != 0:
            return
        import wandb

        histograms = {
            f"moe/{name}/expert_load": wandb.Histogram(np_histogram=(loads, list(range(len(loads) + 1))))
            for name, loads in self.expert_loads.items()
        }
        for logger in loggers:
            logger.experiment.log({**histograms, "trainer/global_step": trainer.global_step})

    def metrics(self, trainer: L.Trainer) -> dict[str, float]:
        """The ``moe/*`` values of the routes counted since the last call (which resets the counts)."""
        names = list(self._layers)
        widest = max(c.numel() for c in self._layers.values())
        counts = torch.full((len(names), widest), float("nan"), device=next(iter(self._layers.values())).device)
        for row, name in enumerate(names):
            counts[row, : self._layers[name].numel()] = self._layers[name]
            self._layers[name].zero_()
        aux = [m.aux_loss.detach().float() for m in self._aux_modules if isinstance(m.aux_loss, torch.Tensor)]
        aux_sum = torch.stack(aux).sum().to(counts.device) if aux else torch.zeros((), device=counts.device)
        if contract_of(trainer).layout.pp == 1:  # the rows are the same layers on every rank
            counts = contract_of(trainer).reduce_across_ranks(counts, "mean")
            aux_sum = contract_of(trainer).reduce_across_ranks(aux_sum, "mean")
        loads = counts / counts.nanmean(1, keepdim=True).clamp_min(1e-12)  # routes per expert over the mean
        max_load = loads.nan_to_num(0).amax(1)
        empty = (counts == 0).sum(1) / (~counts.isnan()).sum(1)
        values, k = (
            torch.cat([max_load, empty.to(max_load.dtype), aux_sum.view(1), loads.flatten()]).tolist(),
            len(names),
        )  # one read
        max_load, empty, aux_value = values[:k], values[k : 2 * k], values[2 * k]
        rows = [values[2 * k + 1 + row * widest : 2 * k + 1 + (row + 1) * widest] for row in range(k)]
        self.expert_loads = {n: row[: self._layers[n].numel()] for n, row in zip(names, rows)}
        metrics = {f"moe/{n}/max_load": v for n, v in zip(names, max_load)}
        metrics |= {f"moe/{n}/empty_experts": v for n, v in zip(names, empty)}
        metrics |= {"moe/max_load": max(max_load), "moe/empty_experts": sum(empty) / len(names)}
        if aux:
            metrics["moe/aux_loss"] = aux_value
        return metrics

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._layers = [], {}
