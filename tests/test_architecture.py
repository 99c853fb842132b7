"""The structure the code promises (docs/architecture.md), checked by tools so it cannot drift.

* import-linter: the layers of ``[tool.importlinter]`` in pyproject.toml (nothing imports upward, no cycles
  between the sub-packages of ``parallel``, ``checkpointing`` and ``contract``);
* ruff: lint and format clean;
* callbacks read the run only through the contract: no strategy-type or method-identity probes.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    found = BIN / name if (BIN / name).exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; `pip install -e '.[dev]'` installs it")
    return str(found)


def test_imports_follow_the_layers():
    result = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run([_tool("ruff"), *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


PROBED = ("Strategy", "CheckpointHooks")


def _probes(source: str) -> list[str]:
    """``isinstance(x, <...Strategy...>)`` and ``type(x).method is Strategy.method`` in a module's code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        is_type_check = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
        if is_type_check and len(node.args) == 2 and any(s in ast.unparse(node.args[1]) for s in PROBED):
            found.append(ast.unparse(node))
        is_identity = isinstance(node, ast.Compare) and any(isinstance(op, ast.Is) for op in node.ops)
        if is_identity and "Strategy." in ast.unparse(node):
            found.append(ast.unparse(node))
    return found


def test_the_probe_finder_finds_probes():
    # Negative control: the check below would fail on the probes that callbacks used to hold.
    source = "isinstance(trainer.strategy, DeepSpeedStrategy)\ntype(s).save_checkpoint is Strategy.save_checkpoint\n"
    assert len(_probes(source)) == 2


def test_callbacks_read_the_run_only_through_the_contract():
    probes = {
        path.name: found
        for path in sorted((ROOT / "lightning_llm" / "callbacks").glob("*.py"))
        if (found := _probes(path.read_text()))
    }
    assert not probes, f"strategy probes in callbacks (add what they need to the contract instead): {probes}"
