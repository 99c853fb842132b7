"""SIGTERM mid-run: a verified checkpoint of the step it interrupted, a clean end, and a relaunch that continues
as if never stopped (issue 49's graceful preemption).

The oracle is a straight run of the same seed and data: the preempted-then-resumed run must end with the same
weights (within 1e-6, fp32). The signal is real (``os.kill`` of the rank's own process at the end of a chosen step);
on 2 ranks it reaches the ranks at different steps, and all must stop at the first one's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_llm.checkpointing.files import verify

DRIVER = Path(__file__).with_name("_preemption.py")
ROOT = Path(__file__).parents[2]
GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds


def _train(workdir: Path, max_steps: int, signals: str, *layout: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, str(DRIVER), str(workdir), str(max_steps), signals, *layout],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _max_difference(a: Path, b: Path) -> float:
    first, second = torch.load(a), torch.load(b)
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "layout, signals",
    [
        pytest.param([], "0:5", id="single-process"),
        pytest.param(["--async_save"], "0:5", id="single-process-async-saves"),
        # SLURM's warning ahead of the time limit (#SBATCH --signal=B:USR1@120); its default action would kill
        pytest.param(["--signal", "SIGUSR1"], "0:5", id="single-process-slurm-usr1"),
        # rank 1 takes the signal first, rank 0 a step later (torchrun forwards it to every worker)
        pytest.param(["--ranks", "2"], "1:5,0:6", id="2-ranks-zero3"),
    ],
)
def test_sigterm_saves_the_interrupted_step_and_the_relaunch_continues_exactly(tmp_path, layout, signals):
    straight, stopped, resumed = _train(tmp_path, 10, signals, *layout)
    assert straight["step"] == 10 and straight["seconds_after_signal"] is None and not straight["preempted"]

    assert stopped["step"] == 5 and stopped["preempted"], stopped
    assert stopped["seconds_after_signal"] < GRACE_S, stopped
    # Committed (marker written after every rank finished and the files verified), beside the periodic one of step 4.
    assert stopped["committed"] == ["step=00000004.ckpt", "step=00000005.ckpt"], stopped
    verify(str(tmp_path / "run" / "step=00000005.ckpt"), trial_load=True)  # every part there and readable; it loads

    assert resumed["step"] == 10 and not resumed["preempted"]
    assert _max_difference(tmp_path / "straight.pt", tmp_path / "resumed.pt") <= 1e-6


def test_the_flag_records_sigterm_and_gives_back_the_handler_it_replaced_even_when_installed_twice():
    """A fit that ended by an exception leaves the flag installed (Lightning restores its own handlers, not the
    callbacks'); the next fit installs it again, and uninstalling must still restore the handler from before."""
    import os
    import signal
    import time

    from lightning_llm.callbacks.preemption import PreemptionFlag

    original = signal.getsignal(signal.SIGTERM)
    flag = PreemptionFlag()
    flag.install()
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not flag.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flag.received
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) == original


@pytest.mark.parametrize("signals", ["SIGTERM", [], ["SIGKILL"], ["SIGNOPE"]])
def test_preemption_signals_that_cannot_be_caught_or_are_not_a_list_are_refused(signals):
    from lightning_llm.callbacks import CheckpointRotation

    with pytest.raises(ValueError, match="preemption_signals"):
        CheckpointRotation(preemption_signals=signals)
