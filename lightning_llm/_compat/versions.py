"""Features that need a newer torch than the oldest one supported (2.11): checked once, refused by name."""

from __future__ import annotations

import torch


def torch_at_least(version: str) -> bool:
    """Whether the installed torch is ``version`` or newer (``torch.__version__`` compares with strings)."""
    return torch.__version__ >= version


def require_torch(version: str, feature: str, why: str) -> None:
    """Refuse ``feature`` on a torch older than ``version``, naming both and ``why``.

    Example::

        require_torch("2.13", "pipeline_schedule='ZBVZeroBubble'", "torch 2.11's V schedule cannot start on gloo")
    """
    if not torch_at_least(version):
        raise RuntimeError(
            f"{feature} needs torch >= {version}; this is torch {torch.__version__} ({why}). "
            f"Upgrade torch, or choose another option."
        )
