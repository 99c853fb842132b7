"""Print pyproject's dependency floors as pip pins (``name==floor``), one a line, for the minimum-versions job.

Every requirement of ``[project] dependencies`` and of the ``dev`` extra that has a ``>=`` floor becomes
``name==floor`` (extras kept, e.g. ``jsonargparse[signatures]==4.32``); exact pins (``==``) are kept as they
are; a requirement without a floor (``numpy``) is left to the resolver and listed on stderr. Used as a pip
constraints file, so ``pip install -e ".[dev]"`` resolves with every floored package at exactly its floor.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(>=|==)\s*([0-9][0-9A-Za-z.+]*)\s*$")


def pins(project: dict) -> tuple[list[str], list[str]]:
    """(``name==version`` pins for every floored or pinned requirement, the names of those without a floor)."""
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    pinned, unfloored = {}, []
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        if match is None:
            unfloored.append(requirement)
            continue
        name = match.group(1).lower()
        pinned[name] = f"{name}=={match.group(4)}"  # constraints take no extras; the extra still installs
    return list(pinned.values()), unfloored


def main() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    pinned, unfloored = pins(project)
    print("\n".join(pinned))
    if unfloored:
        print(f"no floor (newest installed): {', '.join(unfloored)}", file=sys.stderr)


if __name__ == "__main__":
    main()
