"""Graceful preemption: on SIGTERM, a verified checkpoint of the last finished step, then a normal end of ``fit``.

Clusters preempt with SIGTERM and a grace period (Kubernetes: 30 s by default; SLURM: ``KillWait``, or
``#SBATCH --signal=TERM@120`` ahead of the time limit); torchrun forwards it to every worker, Lightning's own launcher
to its child ranks. Lightning's signal connector stops on SIGTERM but does not save, and it broadcasts from inside
the signal handler: when ranks see the signal at different points of a step (one blocked in a collective, one
not), those broadcasts pair with the wrong collectives and the job hangs or corrupts its save (seen here: a sharded
save written to a directory another rank's mismatched collective never created). So while
:class:`~lightning_llm.callbacks.CheckpointRotation` trains, SIGTERM only sets a flag; at the end of every
optimizer step the ranks agree on it (one all-reduce of a bit, as Lightning's own per-step broadcast), and all of
them save the same step through the usual write, verify, commit and rotate path, then stop through
``trainer.should_stop``, so ``on_train_end`` and the loggers finish as after a normal run.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class PreemptionFlag:
    """SIGTERM's handler while training: it records the signal and nothing else (no collective, no I/O).

    Example::

        flag = PreemptionFlag()
        flag.install()
        ...
        if flag.any_rank(trainer.strategy):  # at a step boundary, on every rank
            ...
        flag.uninstall()
    """

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Take SIGTERM (only the main thread may set signal handlers; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.received = False
        previous = signal.signal(signal.SIGTERM, self._handle)
        # Still ours when a fit ended by an exception (Lightning then restores its handlers, not the callbacks)
        # and the next fit installs again: keep the handler from before the first install.
        if previous != self._handle:
            self._previous = previous
        self._installed = True

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler it had (Lightning's, which Lightning restores at its teardown)."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def any_rank(self, strategy: Any) -> bool:
        """Whether any rank received SIGTERM; a collective, so every rank calls it at the same step."""
        return bool(strategy.reduce_boolean_decision(self.received, all=False))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True


def stop_for_preemption(trainer: L.Trainer, saved_now: bool, seconds: float) -> None:
    """End ``fit`` after this step (``trainer.should_stop``) and say what was saved."""
    trainer.should_stop = True
    step = trainer.global_step
    what = f"checkpoint of step {step} saved and verified in {seconds:.1f} s" if saved_now else f"step {step} was saved"
    rank_zero_info(f"Preempted (SIGTERM): {what}; stopping. Resume with ckpt_path='last'.")
