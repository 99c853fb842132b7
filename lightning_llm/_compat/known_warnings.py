"""Warnings that installed upstream versions print about each other, filtered by their exact text, with why.

Each entry is a deprecation one upstream package raises about another's code, that a user can do nothing
about and that changes nothing in the run. Nothing else is filtered: warnings about the user's code or
setup stay visible. Installed when :mod:`lightning_llm` is imported.
"""

from __future__ import annotations

import warnings

KNOWN = {
    # Lightning 2.6.6's lightning/pytorch/utilities/_pytree.py checks `isinstance(spec, LeafSpec)` for every batch,
    # which torch 2.13 deprecates in favour of `spec.is_leaf()`. The check still answers the same; once per rank.
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*": "Lightning's batch-size detection under torch >= 2.13",
}


def install() -> None:
    """Filter the :data:`KNOWN` messages (process-wide, as ``warnings.filterwarnings`` is)."""
    for message in KNOWN:
        warnings.filterwarnings("ignore", message=message)
