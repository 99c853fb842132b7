"""The process's background checkpoint writer: one thread, and a gate that holds a write until training resumes.

Between a save's host copy and the next step, the training thread still runs Python (the rest of
Lightning's callbacks, fetching the batch, the next step's collectives). A writer started at once
pickles and plans meanwhile, and the threads hand the GIL back and forth: measured on the 37 MB
checkpoint of ``benchmarks/checkpoint_stall.py``, ~1 ms of a ~6 ms stall for a single file, more for
sharded DCP saves, whose background thread also plans collectively. So a background write waits for
:func:`resume_background_writes` (CheckpointRotation calls it when the next batch starts, and before
anything waits for a write), or ``WriteGate.TIMEOUT`` seconds at most, so a write whose caller never
resumes still happens.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class WriteGate:
    """A gate background writes wait at: held by a save, released when training resumes (or after ``TIMEOUT``).

    Example::

        gate = WriteGate()
        gate.hold()
        executor.submit(lambda: (gate.wait(), write(staged)))   # starts once released
        gate.release()
    """

    TIMEOUT = 1.0  # seconds

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def wait(self) -> None:
        self._open.wait(self.TIMEOUT)


BACKGROUND_WRITES = WriteGate()  # the process's checkpoint writes (single files and sharded DCP saves)


def resume_background_writes() -> None:
    """Let a background checkpoint write held since its save start now (a no-op when none is held).

    Example::

        future = contract_of(trainer).save_checkpoint_async("step=4.ckpt")
        ...                              # training goes on: the next batch starts
        resume_background_writes()       # the write begins; future.result() waits for it
    """
    BACKGROUND_WRITES.release()


_WRITER: ThreadPoolExecutor | None = None


def background_writer() -> ThreadPoolExecutor:
    """The one thread that writes checkpoints in the background (single files and sharded saves), so saves are
    written in the order they were made."""
    global _WRITER
    if _WRITER is None:
        _WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
    return _WRITER
