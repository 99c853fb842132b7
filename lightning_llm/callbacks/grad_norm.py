"""GradNormMonitor: the true global gradient norm before clipping, under every layout."""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from lightning_llm.callbacks import cadence
from lightning_llm.contract import contract_of
from lightning_llm.modeling.blocks import block_modules, find_blocks
from lightning_llm.validation import check_bool, check_float, check_int


class GradNormMonitor(L.Callback):
    """Logs the total gradient norm before clipping, whether the step was clipped, and optional finer norms.

    Logged once per optimizer step (so after all accumulated micro-batches), every
    ``log_every_n_steps`` steps: ``grad_norm/total``, ``grad_norm/was_clipped`` (1.0 when the norm exceeds
    the Trainer's ``gradient_clip_val``), with ``per_block=True`` ``grad_norm/block_{i}`` for each
    transformer block and with ``per_param_group=True`` ``grad_norm/group_{i}`` for each parameter group
    of the optimizer. Every norm is global: over data-parallel replicas, FSDP and tensor-parallel
    shards and pipeline stages. Computing one takes collectives, so steps in between add none. Where the
    strategy computes the norm inside its step (DeepSpeed: ``grad_norm_ready == "after_optimizer_step"`` in
    its contract) its own pre-clipping global norm is read after the step (finer norms are not available
    there: the engine owns the gradient partitions).

    Arguments:
        log_every_n_steps: optimizer steps between logs; default: the Trainer's.
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
        per_block: also log each transformer block's norm.
        per_param_group: also log the norm of each of the optimizer's parameter groups.

    Example::

        trainer = L.Trainer(gradient_clip_val=1.0, callbacks=[GradNormMonitor(per_block=True)])
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        norm_type: float = 2.0,
        per_block: bool = False,
        per_param_group: bool = False,
    ) -> None:
        check_int("log_every_n_steps", log_every_n_steps, minimum=1, optional=True)
        check_float("norm_type", norm_type, allow_inf=True)
        check_bool("per_block", per_block)
        check_bool("per_param_group", per_param_group)
        if norm_type <= 0:
            raise ValueError(f"norm_type={norm_type} must be positive (2.0 for the L2 norm, inf for the max norm).")
        self.log_every_n_steps = log_every_n_steps
        self.norm_type = float(norm_type)
        self.per_block = per_block
        self.per_param_group = per_param_group
        self.last_norm: torch.Tensor | None = None
        self._read_at = 0  # the global step whose after-the-step norm (DeepSpeed) was read last

    def _due(self, trainer: L.Trainer) -> bool:
        # on_before_optimizer_step runs before global_step counts this step.
        return cadence.due(trainer, self.log_every_n_steps, counted=False)

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        cadence.check_multiple(trainer, self.log_every_n_steps, type(self).__name__)
        self._read_at = trainer.global_step  # a resumed run has no norm of its own yet

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        contract = contract_of(trainer)
        if contract.grad_norm_ready != "before_optimizer_step" or not self._due(trainer):
            return
        self._log(trainer, pl_module, contract.grad_norm(norm_type=self.norm_type))
        if self.per_block:
            _, blocks = find_blocks(pl_module, contract.blocks_name)
            # Blocks held by another pipeline stage contribute zero here and their norm over the group.
            # From the registry: a pipeline stage's gated list yields stand-ins for other stages' blocks.
            for index, block in enumerate(block_modules(blocks)):
                self._log_one(pl_module, f"block_{index}", contract.grad_norm(block.parameters(), self.norm_type))
        if self.per_param_group:
            for index, group in enumerate(optimizer.param_groups):
                self._log_one(pl_module, f"group_{index}", contract.grad_norm(group["params"], self.norm_type))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        contract = contract_of(trainer)
        if (
            contract.grad_norm_ready != "after_optimizer_step"
            or not cadence.due(trainer, self.log_every_n_steps, counted=True)
            or step == self._read_at
        ):
            return  # read before the step, not due, or a micro-batch that accumulated without a step
        self._read_at = step
        norm = contract.step_grad_norm()
        if norm is not None:
            self._log(trainer, pl_module, norm)

    def _log(self, trainer, pl_module, norm: torch.Tensor) -> None:
        self.last_norm = norm
        self._log_one(pl_module, "total", norm)
        clip = trainer.gradient_clip_val
        if clip is not None and clip > 0 and trainer.gradient_clip_algorithm in (None, "norm"):
            self._log_one(pl_module, "was_clipped", (norm > clip).float())

    @staticmethod
    def _log_one(pl_module, name: str, value: torch.Tensor) -> None:
        pl_module.log(f"grad_norm/{name}", value, on_step=True, on_epoch=False)
