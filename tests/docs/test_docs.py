"""The docs site builds with warnings as errors, and every ```python and ```bash block of docs/ and the README runs on
CPU, unless it is marked with the reason it cannot (a GPU, several nodes, a fresh machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._env import fresh_launch_env
from tests.docs.snippets import ROOT, collect, collect_all

pytest.importorskip("sphinx", reason="the docs need the dev extra (sphinx, myst-parser, furo)")

# Spawned ranks and Sphinx's autodoc import torch and Lightning: keep them to one thread as the suite does.
# Without the launch variables earlier in-process tests left (tests/_env.py).
_ENV = fresh_launch_env(OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT))


@pytest.mark.timeout(300)
def test_site_builds_without_warnings(tmp_path):
    # -n -W: a warning (a broken link, a cross-reference to a name of this package that does not exist, a docstring
    # autodoc cannot parse, a page outside every toctree) fails the build; --keep-going reports all of them at once.
    # -E: no cached environment.
    command = [sys.executable, "-m", "sphinx", "-n", "-W", "--keep-going", "-E", "-q", "-b", "html"]
    result = subprocess.run(
        [*command, str(ROOT / "docs"), str(tmp_path / "html")], env=_ENV, capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "html" / "index.html").is_file()


@pytest.mark.timeout(1200)
def test_every_code_block_runs():
    result = subprocess.run(
        [sys.executable, "-m", "tests.docs.snippets"], cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=1180
    )
    assert result.returncode == 0, f"doc snippets failed:\n{result.stdout[-4000:]}\n{result.stderr[-12000:]}"


def test_skipped_blocks_give_a_reason_and_most_blocks_run():
    snippets = collect_all()
    assert snippets, "no code blocks found"
    assert all(s.skip.strip() for s in snippets if s.skip is not None)
    assert any(s.path.name == "README.md" and s.skip is None for s in snippets), "the README's example must run"
    assert sum(s.skip is None for s in snippets) > len(snippets) / 2


def test_collector_reads_skip_and_continued_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- continued -->\n```python\nprint(x)\n```\n\n"
        "<!-- skip: needs GPU -->\n```python\nimport torch; torch.ones(1, device='cuda')\n```\n\n```bash\nls\n```\n"
    )
    first, second, third, shell = collect(page)
    assert (first.code, first.skip, first.line) == ("x = 1\n", None, 3)
    assert second.code == "x = 1\n\nprint(x)\n" and second.skip is None
    assert third.skip == "needs GPU"
    assert (shell.lang, shell.code, shell.skip) == ("bash", "ls\n", None)
    page.write_text("<!-- todo -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="skip: REASON"):
        collect(page)
