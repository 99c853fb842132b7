"""Lightning's step hooks through a pipeline schedule, as functions of a :class:`~.pipelined_steps.PipelinedSteps`.

With pipeline parallelism, LLMParallelStrategy's ``training_step``, ``validation_step``, ``test_step`` and
``backward`` (:class:`PipelineStepHooksMixin`) call these (without it, the parent strategy's). One training step
runs the schedule's forward and backward of every micro-batch, so Lightning's own backward only adds the step's
gradients (its hooks still run); evaluation runs forward-only through the schedule.
"""

from __future__ import annotations

from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_llm.parallel.data_parallel import syncs_every_micro_batch
from lightning_llm.strategies.pipelined_steps import PipelinedSteps
from lightning_llm.strategies.run_state import RunState


class PipelineStepHooksMixin(ModelParallelStrategy):
    """The step hooks of :class:`~lightning_llm.strategies.LLMParallelStrategy` (a base of it, not a strategy of
    its own): through the pipeline schedule when ``self.run_state.pipelined`` holds one, else the parent's."""

    run_state: RunState

    @override
    def training_step(self, *args, **kwargs):
        steps = self.run_state.pipelined
        if steps is None:
            return super().training_step(*args, **kwargs)
        batch, index = batch_and_index(args, kwargs)
        every = None if self.run_state.accumulating else self._syncs_every_micro_batch()
        return training_step(steps, self.lightning_module, self.precision_plugin, batch, index, every)

    def _syncs_every_micro_batch(self) -> bool:
        """Whether micro-batches before an optimizer step's last reduce their gradients (``accumulation_sync``)."""
        return syncs_every_micro_batch(self.options.parallel.accumulation_sync, self.zero_stage)

    @override
    def validation_step(self, *args, **kwargs):
        if self.run_state.pipelined is None:
            return super().validation_step(*args, **kwargs)
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args, **kwargs):
        if self.run_state.pipelined is None:
            return super().test_step(*args, **kwargs)
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def _evaluation_step(self, name: str, context, args, kwargs) -> None:
        batch, index = batch_and_index(args, kwargs)
        evaluation_step(self.run_state.pipelined, self.lightning_module, name, context, batch, index)

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        steps = self.run_state.pipelined
        if steps is None:
            output = super().backward(closure_loss, optimizer, *args, **kwargs)
            guard = getattr(self.run_state.report, "output_guard", None)
            if guard is not None:
                guard.check()
            return output
        return backward(steps, self.lightning_module, self.precision_plugin, closure_loss)


def batch_and_index(args: tuple, kwargs: dict) -> tuple:
    """The batch and batch index of a Lightning step hook's arguments."""
    return args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)


def training_step(
    steps: PipelinedSteps, module, precision: Precision, batch, batch_idx: int, every_micro_batch: bool | None
):
    """One optimizer step's micro-batches through the schedule (fp16's loss scaler reaches it from ``precision``;
    ``every_micro_batch``: :meth:`PipelinedSteps.training_step`)."""
    with precision.train_step_context():
        accumulate = module.trainer.accumulate_grad_batches
        scaler = precision.scaler if isinstance(precision, MixedPrecision) else None
        return steps.training_step(module, batch, batch_idx, accumulate, scaler, every_micro_batch)


def evaluation_step(steps: PipelinedSteps, module, name: str, context, batch, batch_idx: int) -> None:
    """``module``'s ``name`` ("validation_step" or "test_step") forward-only through the schedule, in ``context``."""
    with context():
        steps.evaluation_step(module, getattr(module, name), batch, batch_idx)


def backward(steps: PipelinedSteps, module, precision: Precision, closure_loss):
    """The schedule already ran every micro-batch's backward: add the step's gradients between Lightning's hooks."""
    precision.pre_backward(closure_loss, module)  # Lightning's on_before_backward hooks
    steps.add_step_gradients(module)
    precision.post_backward(closure_loss, module)  # and on_after_backward
    return closure_loss


def check_microbatches(
    trainer, pipeline_parallel_size: int, num_microbatches: int | None, requested: int | None = None
) -> None:
    """Refuse, before the first step, a per-rank batch the pipeline cannot cut into equal micro-batches.

    ``requested`` is the user's ``num_microbatches`` (``None``: the count was chosen at setup, which is said)."""
    hparams = getattr(trainer.datamodule, "hparams", {}) if trainer.datamodule is not None else {}
    batch_size, micro = hparams.get("batch_size"), num_microbatches
    if pipeline_parallel_size > 1 and isinstance(batch_size, int) and batch_size % micro:
        chosen = "" if requested is not None else " (left unset, so one per pipeline stage)"
        raise ValueError(
            f"batch_size={batch_size} (per data-parallel rank) is not divisible by num_microbatches={micro}{chosen}, "
            f"so it cannot be cut into equal micro-batches; use a batch_size that is a multiple of {micro}, or a "
            "num_microbatches that divides it."
        )
