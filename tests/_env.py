"""The environment of a process a test starts as a user's shell would: no launch variables of the test process.

Earlier in-process tests leave what Lightning and torch.distributed set in ``os.environ`` (``LOCAL_RANK``,
``MASTER_PORT``, ``PL_*``...). A child that inherits ``LOCAL_RANK`` believes it was launched as one rank of a job
and never starts the others (a 4-device fit then waits forever); an inherited ``MASTER_PORT`` may be taken.
"""

from __future__ import annotations

import os

LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
)


def fresh_launch_env(**updates: str) -> dict[str, str]:
    """``os.environ`` without launch variables (and Lightning's ``PL_*``, torchelastic's), plus ``updates``."""
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith(("PL_", "TORCHELASTIC_"))
    }
    env.update(updates)
    return env
