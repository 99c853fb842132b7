"""The Lightning step hooks of a strategy that may run a pipeline schedule (mixed into LLMParallelStrategy).

Without pipeline parallelism (``self._pipelined is None``) every hook is the parent strategy's. With
it, one training step runs the schedule's forward and backward of every micro-batch, so Lightning's
own backward only adds the step's gradients (its hooks still run); evaluation runs forward-only
through the schedule.
"""

from __future__ import annotations

from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override


class PipelineHooks:
    """Step hooks that route through ``self._pipelined`` (a :class:`~.pipelined_steps.PipelinedSteps`) when set."""

    _pipelined = None

    @override
    def training_step(self, *args, **kwargs):
        if self._pipelined is None:
            return super().training_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        with self.precision_plugin.train_step_context():
            accumulate = self.lightning_module.trainer.accumulate_grad_batches
            scaler = self.precision_plugin.scaler if isinstance(self.precision_plugin, MixedPrecision) else None
            return self._pipelined.training_step(self.lightning_module, batch, batch_idx, accumulate, scaler)

    @override
    def validation_step(self, *args, **kwargs):
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args, **kwargs):
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def _evaluation_step(self, name: str, context, *args, **kwargs):
        if self._pipelined is None:
            return getattr(super(), name)(*args, **kwargs)
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        with context():
            self._pipelined.evaluation_step(
                self.lightning_module, getattr(self.lightning_module, name), batch, batch_idx
            )
        return None

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self._pipelined is not None:  # the schedule already ran every micro-batch's backward
            module = self.lightning_module
            self.precision_plugin.pre_backward(closure_loss, module)  # Lightning's on_before_backward hooks
            self._pipelined.add_step_gradients(module)
            self.precision_plugin.post_backward(closure_loss, module)  # and on_after_backward
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _check_microbatches(self, trainer) -> None:
        """Refuse, before the first step, a per-rank batch the pipeline cannot cut into equal micro-batches."""
        hparams = getattr(trainer.datamodule, "hparams", {}) if trainer.datamodule is not None else {}
        batch_size, micro = hparams.get("batch_size"), self.pipeline.num_microbatches
        if self.pipeline_parallel_size > 1 and isinstance(batch_size, int) and batch_size % micro:
            raise ValueError(
                f"batch_size={batch_size} (per data-parallel rank) is not divisible by num_microbatches={micro}, so it "
                f"cannot be cut into equal micro-batches; use a batch_size that is a multiple of {micro}, or a "
                "num_microbatches that divides it."
            )
