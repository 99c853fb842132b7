"""Reading back what an offline W&B run wrote, allowing for its writer process still flushing."""

import time
from collections.abc import Callable
from pathlib import Path


def read_when(path: Path, complete: Callable[[bytes], bool], within: float = 60.0) -> bytes:
    """The bytes of W&B's run file once ``complete`` holds for them, or as they are after ``within`` seconds.

    W&B's writer process may still be filling the file after ``wandb.finish()`` returns (seen on W&B 0.19 and 0.31
    on loaded machines), so the file is read again until the test's whole record is there; the test then asserts on
    what was read, so a record that never arrives still fails.
    """
    deadline = time.monotonic() + within
    while True:
        written = path.read_bytes()
        if complete(written) or time.monotonic() > deadline:
            return written
        time.sleep(0.5)
