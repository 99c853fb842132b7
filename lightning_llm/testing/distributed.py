"""Run a function on N gloo ranks from pytest (or any script), with a timeout.

Lightning's default launcher re-executes ``sys.argv``, which inside pytest would re-run
the test session. Here each rank is a fresh process that gets the caller's environment and working directory plus
the ``torch.distributed`` variables (``MASTER_ADDR``/``PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``).
Lightning's ``LightningEnvironment`` sees ``LOCAL_RANK`` and treats the processes as externally launched, so a
plain ``Trainer(devices=N, accelerator="cpu")`` inside ``fn`` joins the group instead of launching. Outside
Lightning, ``fn`` may call ``init_process_group("gloo")`` itself.

Where the platform has it, ranks are forked from multiprocessing's ``forkserver``: a server process, started at
the first call, that has imported torch, Lightning and this package once (:data:`PRELOAD`). A rank then starts in
a fraction of a second instead of importing them again (about 5 s for two ranks on two cores, most of a small
test's time), and still from a clean interpreter, not a copy of the caller. Elsewhere ranks are ``spawn``-ed.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

# What the forkserver imports once for every rank it forks (an import that fails is skipped by multiprocessing):
# what nearly every rank imports, and nothing that reads the environment when imported (W&B, DeepSpeed).
PRELOAD = [
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "lightning_llm.strategies",
    "lightning_llm.testing",
    "transformers",
    "pytest",
]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _context():
    """``forkserver`` with :data:`PRELOAD` where the platform has it, else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call's
    return ctx


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, results, env, crash_log, args, kwargs) -> None:
    # A rank killed by a signal (a segfault in a native library) reports nothing through ``results``: its Python
    # stack goes to a file the caller reads, since a forked rank's stderr is the server's, not the caller's.
    # A rank still running at the timeout is sent SIGUSR1 and writes every thread's stack to the same file: where
    # a hung collective waits.
    log = open(crash_log, "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(log)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    # A forked rank has the server's environment, from when it started: the caller's is the one that counts.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    # One intra-op thread per rank: N ranks on a 2-core machine must not oversubscribe it.
    torch.set_num_threads(1)
    try:
        # Pickled by value here: torch's queue pickler would share tensor storage through file
        # descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class DistributedTestError(RuntimeError):
    """A rank failed or the group did not finish in time."""

    def __init__(self, message: str, only_peers_lost: bool = True, timed_out: bool = False) -> None:
        super().__init__(message)
        self.only_peers_lost = only_peers_lost  # no rank raised an error of its own
        self.timed_out = timed_out


class NativeCrashRetried(UserWarning):
    """A rank died of a native crash and :func:`run_distributed` ran the group again."""


class _NativeCrash(DistributedTestError):
    """A rank was killed by a crash signal and no rank raised a Python error."""


_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)


def _crashed_natively(procs) -> bool:
    return any(p.exitcode is not None and -p.exitcode in _CRASH_SIGNALS for p in procs)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, native_crash_retries: int = 1, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes; return the results ordered by rank.

    ``fn`` and its arguments must be picklable (a module-level function). If any rank raises,
    the others are stopped and :class:`DistributedTestError` carries the first failing rank's
    traceback. If the group has not finished after ``timeout`` seconds (a hung collective),
    every rank is killed and the error says which ranks never reported, with the Python stack each was in.

    A group in which a rank died of a native crash (SIGSEGV, SIGABRT, SIGBUS) while no rank raised is run again from
    the start, up to ``native_crash_retries`` times, with a :class:`NativeCrashRetried` warning that carries the
    crashed rank's stack: gloo's TCP transport on a loaded two-core machine crashed so three times in the full suites
    of 27-28 November 2026, each time in a different test that passed when run again. A Python error, a
    timeout, or a crash that comes back is never retried.

    Example::

        def all_reduce_sum():
            torch.distributed.init_process_group("gloo")
            t = torch.tensor([torch.distributed.get_rank() + 1.0])
            torch.distributed.all_reduce(t)
            return t.item()

        assert run_distributed(all_reduce_sum, 2) == [3.0, 3.0]
    """
    for attempt in range(native_crash_retries + 1):
        try:
            return _run_group(fn, world_size, args, kwargs, timeout)
        except _NativeCrash as crash:
            if attempt == native_crash_retries:
                raise DistributedTestError(str(crash)) from None
            warnings.warn(f"Running the group again after a native crash:\n{crash}", NativeCrashRetried, stacklevel=2)
    raise AssertionError("unreachable")


def _run_group(fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="run_distributed-") as logs:
        crash_logs = [os.path.join(logs, f"rank{rank}.crash") for rank in range(world_size)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, results, env, crash_logs[rank], args, kwargs),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, results, world_size, timeout)
        except DistributedTestError as err:
            crashes = _native_crashes(procs, crash_logs) + (_hung_stacks(procs, crash_logs) if err.timed_out else "")
            retriable = err.only_peers_lost and _crashed_natively(procs)
            raise (_NativeCrash if retriable else DistributedTestError)(f"{err}{crashes}") from None
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)


def _native_crashes(procs, crash_logs: list[str]) -> str:
    """The Python stacks faulthandler wrote for ranks a signal killed, as text to append to an error."""
    out = []
    for rank, (proc, path) in enumerate(zip(procs, crash_logs, strict=True)):
        if not proc.is_alive() and proc.exitcode < 0 and os.path.exists(path):
            with open(path) as f:
                stack = f.read().strip()
            if stack:
                out.append(f"\n\nRank {rank} was killed by signal {-proc.exitcode}; its stack:\n{stack}")
    return "".join(out)


def _hung_stacks(procs, crash_logs: list[str], wait: float = 5.0) -> str:
    """The stacks of the ranks still running at a timeout, as text to append to the error: where each one waits."""
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    if not hung:
        return ""
    for rank in hung:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(os.path.getsize(crash_logs[rank]) for rank in hung):
        time.sleep(0.2)
    time.sleep(0.5)  # the last rank to start writing finishes
    out = []
    for rank in hung:
        with open(crash_logs[rank]) as f:
            stack = f.read().strip()
        out.append(f"\n\nRank {rank} was still running; its threads' stacks:\n{stack or '(none written)'}")
    return "".join(out)


def _collect(procs, results, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    while len(outputs) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise DistributedTestError(
                f"Timed out after {timeout:.0f}s; ranks {missing} never finished.", timed_out=True
            )
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
            dead = [r for r in dead if r not in outputs]
            if dead:
                codes = {r: procs[r].exitcode for r in dead}
                raise DistributedTestError(f"Ranks {dead} died without reporting (exit codes {codes}).") from None
            continue
        if status == "error":
            errors = {rank: value}
            report = _failure_report(procs, results, errors, set(outputs), world_size)
            raise DistributedTestError(report, only_peers_lost=all(_lost_peer(e) for e in errors.values()))
        outputs[rank] = pickle.loads(value)
    return [outputs[r] for r in range(world_size)]


# A rank that lost its peer fails with one of these; the peer's own error is the one to show first.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def _lost_peer(error: str) -> bool:
    return any(s in error for s in _PEER_LOST)


def _failure_report(procs, results, errors: dict[int, str], finished: set[int], world_size: int) -> str:
    """Every rank's fate a few seconds after the first error: the root cause first, then the rest.

    The first traceback to arrive is often a rank that only saw its peer go away (gloo's
    "Connection reset by peer"); the peer's own error, or the fact that it finished or died, is
    what explains the failure.
    """
    grace = time.monotonic() + 5.0
    while time.monotonic() < grace and len(errors) + len(finished) < world_size:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in errors and r not in finished):
                break
            continue
        if status == "error":
            errors[rank] = value
        else:
            finished.add(rank)
    primary = min(errors, key=lambda r: (_lost_peer(errors[r]), r))
    lines = [f"Rank {primary} of {world_size} failed:\n{errors[primary]}"]
    for rank in range(world_size):
        if rank == primary:
            continue
        if rank in errors:
            lines.append(f"Rank {rank} also failed: {errors[rank].strip().splitlines()[-1]}")
        elif rank in finished:
            lines.append(f"Rank {rank} finished without error.")
        else:
            lines.append(f"Rank {rank} did not report (exit code {procs[rank].exitcode}).")
    return "\n".join(lines)
