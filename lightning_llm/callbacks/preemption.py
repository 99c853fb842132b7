"""Graceful preemption: on SIGTERM (or another signal named), a verified checkpoint of the last finished step, then a normal end of ``fit``.

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
from collections.abc import Sequence
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class PreemptionFlag:
    """The preemption signals' handler while training: it records the signal and nothing else (no collective, no I/O).

    ``signals``: the names of the signals that mean "preempted": SIGTERM (Kubernetes, SLURM's cancellation, torchrun
    forwarding it), and SLURM's warning ahead of the time limit when the job asks for one (``#SBATCH
    --signal=B:USR1@120`` with ``signals=("SIGTERM", "SIGUSR1")``; Lightning's own SLURM auto-requeue handler of
    SIGUSR1 is replaced while training, so relaunch with ``--requeue`` or a wrapper).

    Example::

        flag = PreemptionFlag(("SIGTERM", "SIGUSR1"))
        flag.install()
        ...
        if flag.any_rank(trainer.strategy):  # at a step boundary, on every rank
            ...
        flag.uninstall()
    """

    def __init__(self, signals: Sequence[str] = ("SIGTERM",)) -> None:
        self.signals = signal_numbers(signals)
        self.received = False
        self.name: str | None = None  # the first signal received
        self._previous: dict[int, Any] = {}
        self._installed = False

    def install(self) -> None:
        """Take the signals (only the main thread may set signal handlers; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.received, self.name = False, None
        for number in self.signals:
            previous = signal.signal(number, self._handle)
            # Still ours when a fit ended by an exception (Lightning then restores its handlers, not the callbacks)
            # and the next fit installs again: keep the handler from before the first install.
            if previous != self._handle:
                self._previous[number] = previous
        self._installed = True

    def uninstall(self) -> None:
        """Give each signal back to the handler it had (Lightning's, which Lightning restores at its teardown)."""
        if self._installed:
            for number in self.signals:
                signal.signal(number, self._previous[number])
            self._installed = False

    def any_rank(self, strategy: Any) -> bool:
        """Whether any rank received a preemption signal; a collective, so every rank calls it at the same step."""
        return bool(strategy.reduce_boolean_decision(self.received, all=False))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        self.name = self.name or signal.Signals(signum).name


def signal_numbers(names: Sequence[str]) -> list[int]:
    """The signal numbers of ``names`` ("SIGTERM", "SIGUSR1", ...); a name that is no catchable signal is refused."""
    if isinstance(names, str) or not names:
        raise ValueError(f"preemption_signals={names!r}: give a list of signal names, e.g. ['SIGTERM', 'SIGUSR1'].")
    numbers = []
    for name in names:
        number = getattr(signal.Signals, str(name), None)
        if number is None or number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"preemption_signals: {name!r} is not a signal a process can catch; use names such as 'SIGTERM' or "
                "'SIGUSR1' (SLURM's #SBATCH --signal=B:USR1@120)."
            )
        numbers.append(int(number))
    return numbers


def stop_for_preemption(trainer: L.Trainer, saved_now: bool, seconds: float, name: str | None = None) -> None:
    """End ``fit`` after this step (``trainer.should_stop``) and say what was saved (``name``: the signal, where
    this rank received one)."""
    trainer.should_stop = True
    step = trainer.global_step
    what = f"checkpoint of step {step} saved and verified in {seconds:.1f} s" if saved_now else f"step {step} was saved"
    rank_zero_info(f"Preempted ({name or 'a signal on another rank'}): {what}; stopping. Resume with ckpt_path='last'.")
