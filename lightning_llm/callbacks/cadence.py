"""The one logging cadence of every callback here: the Trainer's ``log_every_n_steps``, in optimizer steps.

Lightning hands logged values to the loggers only on its logging steps (``global_step`` a multiple of
``log_every_n_steps``, skipping accumulation micro-batches). A value logged on another step would wait
and reach the logger at the next logging step, labelled with that step, as if measured there. So the
callbacks measure over the window since their last log and log on the Trainer's steps; a callback
given its own ``log_every_n_steps`` must use a multiple of the Trainer's, else it is told at setup.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def interval(trainer: L.Trainer, own: int | None) -> int:
    """Optimizer steps between logs: the callback's own ``log_every_n_steps``, else the Trainer's."""
    return own or trainer.log_every_n_steps


def due(trainer: L.Trainer, own: int | None, *, counted: bool) -> bool:
    """Whether this optimizer step is a logging step.

    ``counted``: ``trainer.global_step`` already counts the step (``on_train_batch_end`` after it);
    in ``on_before_optimizer_step`` it does not yet.

    Example::

        if due(trainer, self.log_every_n_steps, counted=False):
            pl_module.log("grad_norm/total", norm)
    """
    every = interval(trainer, own)
    return every > 0 and (trainer.global_step + (0 if counted else 1)) % every == 0


def check_multiple(trainer: L.Trainer, own: int | None, name: str) -> None:
    """Warn when a callback's own interval is not a multiple of the Trainer's (its values would be shown late)."""
    n = trainer.log_every_n_steps
    if own and n and own % n:
        rank_zero_warn(
            f"{name}(log_every_n_steps={own}) is not a multiple of Trainer(log_every_n_steps={n}): Lightning passes "
            f"logged values to the loggers only every {n} steps, so values from step {own} would be shown at step "
            f"{-(-own // n) * n}. Leave log_every_n_steps unset to follow the Trainer, or use a multiple of {n}."
        )
