"""Dependency floors: the installed versions meet pyproject's floors, and every module of the package imports.

The minimum-versions job (``.ci/min_versions``) installs every floor exactly and sets
``LIGHTNING_LLM_EXACT_FLOORS=1``: the versions must then equal the floors, so the tests it runs ran on them.
"""

import importlib
import importlib.util
import os
import pkgutil
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import tomllib
from packaging.version import Version

import lightning_llm

PYPROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9][0-9.]*)")


def _extras_of(name: str) -> list[str]:
    """The extras (besides ``dev``) that install ``name``; empty for a core dependency."""
    if any(_name(r) == name.lower() for r in PYPROJECT["dependencies"]):
        return []
    extras = PYPROJECT["optional-dependencies"]
    return [extra for extra, reqs in extras.items() if extra != "dev" and any(_name(r) == name.lower() for r in reqs)]


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def _floors() -> list[tuple[str, str]]:
    requirements = PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["dev"]
    return [(m.group(1), m.group(3)) for r in requirements if (m := FLOOR.match(r))]


@pytest.mark.parametrize(("name", "floor"), _floors())
def test_installed_version_meets_the_floor(name, floor):
    # CI installs the newest releases; a floor above them would make the package uninstallable.
    try:
        version(name)
    except PackageNotFoundError:
        core = any(_name(r) == name.lower() for r in PYPROJECT["dependencies"])
        if core or os.environ.get("LIGHTNING_LLM_EXACT_FLOORS") == "1":
            raise
        extra = (_extras_of(name) or ["dev"])[0]  # only in `dev`: a development tool (docs build, linters)
        pytest.skip(f"{name} is optional (pip install 'lightning_llm[{extra}]') and not installed here")
    installed = Version(Version(version(name)).public)  # torch's "+cpu" local label aside
    assert installed >= Version(floor), f"{name} {version(name)} is below the floor {floor}"
    if os.environ.get("LIGHTNING_LLM_EXACT_FLOORS") == "1":
        assert installed == Version(floor), f"the minimum-versions job must run {name}=={floor}, not {version(name)}"


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(lightning_llm.__path__, "lightning_llm.")]
    assert len(names) > 50
    for name in names:
        importlib.import_module(name)


def test_the_minimum_versions_job_pins_every_floor():
    # .ci/floors.py writes the pins .ci/min_versions installs: each floor above, exactly, and the exact pins kept.
    spec = importlib.util.spec_from_file_location("floors", Path(__file__).parents[1] / ".ci" / "floors.py")
    floors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floors)
    pins, unfloored = floors.pins(PYPROJECT)
    exact = [
        r.replace(" ", "") for r in PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["dev"] if "==" in r
    ]
    assert sorted(pins) == sorted({f"{name.lower()}=={floor}" for name, floor in _floors()} | set(exact))
    assert unfloored == ["numpy", "psutil", "tqdm", "matplotlib"]
