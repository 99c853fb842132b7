"""Which module names a plan names: its fnmatch patterns, and the subtrees its whole-module entries own.

A plan maps fnmatch patterns over dotted module names (``"layers.*.attention.q_proj"``) to styles. Resolving
plans (:mod:`.plan`), the entries sequence parallelism adds (:mod:`.sequence_parallel_plan`), applying a plan
(:mod:`.apply`) and fp8's exclusions (:mod:`.float8`) all ask these two questions the same way.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

from lightning_llm.parallel.tp.style_kinds import owns_subtree


def matches(name: str, pattern: str) -> bool:
    """Whether the module name ``name`` matches the plan pattern ``pattern`` (case-sensitive fnmatch).

    Example::

        matches("layers.3.attention.q_proj", "layers.*.attention.q_proj")  # True
    """
    return fnmatch.fnmatchcase(name, pattern)


def coverer(plan: dict[str, str]) -> Callable[[str], bool]:
    """Whether a module name is named by ``plan``, directly or under an entry that owns its subtree.

    Example::

        covered = coverer({"layers.*.mlp": "replicate"})
        covered("layers.0.mlp.up_proj")  # True: 'replicate' keeps the whole subtree
    """
    owners = [p for p, s in plan.items() if owns_subtree(s)]

    def covered(name: str) -> bool:
        if any(matches(name, p) for p in plan):
            return True
        parts = name.split(".")
        return any(matches(".".join(parts[:k]), p) for p in owners for k in range(1, len(parts)))

    return covered
