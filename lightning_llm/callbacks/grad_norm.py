"""GradNormMonitor: the true global gradient norm before clipping, under every layout."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from typing_extensions import override

from lightning_llm.parallel.blocks import find_blocks
from lightning_llm.parallel.grad_norm import total_grad_norm


def global_grad_norm(trainer: L.Trainer, pl_module: L.LightningModule, norm_type: float = 2.0) -> torch.Tensor:
    """The norm over every gradient of the model, identical on all ranks.

    LLMParallelStrategy knows its shards, stages and tied copies (``global_grad_norm``); plain
    data parallelism holds whole, already averaged gradients, so the local norm is the global one.
    """
    strategy_norm = getattr(trainer.strategy, "global_grad_norm", None)
    if callable(strategy_norm):
        return strategy_norm(norm_type)
    return total_grad_norm(pl_module.parameters(), norm_type)


class GradNormMonitor(L.Callback):
    """Logs the total gradient norm before clipping, whether the step was clipped, and optional per-block norms.

    Logged once per optimizer step (so after all accumulated micro-batches), every
    ``log_every_n_steps`` steps: ``grad_norm/total``, ``grad_norm/clipped`` (1.0 when the norm exceeds
    the Trainer's ``gradient_clip_val``) and with ``per_block=True`` ``grad_norm/block_{i}``. Computing a
    global norm takes collectives, so steps in between add none. With DeepSpeed the engine's own
    pre-clipping global norm is read after its step.

    Arguments:
        log_every_n_steps: optimizer steps between logs.
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
        per_block: also log each transformer block's norm.

    Example::

        trainer = L.Trainer(gradient_clip_val=1.0, callbacks=[GradNormMonitor(per_block=True)])
    """

    def __init__(self, log_every_n_steps: int = 1, norm_type: float = 2.0, per_block: bool = False) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be at least 1.")
        if norm_type <= 0:
            raise ValueError(f"norm_type={norm_type} must be positive (2.0 for the L2 norm, inf for the max norm).")
        self.log_every_n_steps = log_every_n_steps
        self.norm_type = float(norm_type)
        self.per_block = per_block
        self.last_norm: torch.Tensor | None = None

    def _due(self, trainer: L.Trainer) -> bool:
        # on_before_optimizer_step runs before global_step counts this step.
        return (trainer.global_step + 1) % self.log_every_n_steps == 0

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if isinstance(trainer.strategy, DeepSpeedStrategy) or not self._due(trainer):
            return
        norm = global_grad_norm(trainer, pl_module, self.norm_type)
        self._log(trainer, pl_module, norm)
        if self.per_block:
            self._log_blocks(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(trainer.strategy, DeepSpeedStrategy) or trainer.global_step % self.log_every_n_steps:
            return
        norm = trainer.strategy.deepspeed_engine.get_global_grad_norm()
        if norm is not None:
            self._log(trainer, pl_module, torch.as_tensor(float(norm)))

    def _log(self, trainer, pl_module, norm: torch.Tensor) -> None:
        self.last_norm = norm
        pl_module.log("grad_norm/total", norm, on_step=True, on_epoch=False)
        clip = trainer.gradient_clip_val
        if clip is not None and clip > 0 and trainer.gradient_clip_algorithm in (None, "norm"):
            pl_module.log("grad_norm/clipped", (norm > clip).float(), on_step=True, on_epoch=False)

    def _log_blocks(self, trainer, pl_module) -> None:
        _, blocks = find_blocks(pl_module, getattr(trainer.strategy, "blocks", None))
        group = getattr(trainer.strategy, "pipeline_group", None)
        for index, block in enumerate(blocks._modules.values()):
            # Blocks held by another pipeline stage contribute zero here and their norm over the group.
            norm = total_grad_norm(block.parameters(), self.norm_type, pipeline_group=group)
            pl_module.log(f"grad_norm/block_{index}", norm, on_step=True, on_epoch=False)
