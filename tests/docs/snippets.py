"""Collect the ```python and ```bash blocks of the docs pages and the README, and run them on CPU.

A block runs unless the line right before its opening fence is an HTML comment ``<!-- skip: REASON -->``
(``needs GPU``, ``needs 8 devices``, ``long run``...): the reason is required, so a skipped block says why.
``<!-- continued -->`` there instead makes a block the continuation of the last block before it that is not
itself continued (a tutorial's definitions, then its runs): the two run together as one program.
``python -m tests.docs.snippets`` runs every runnable block, each in a fresh namespace of one interpreter, as
``__main__`` from a file of its own (so ``if __name__ == "__main__":`` and spawned processes work), in a scratch
directory, with a time limit per block; it prints one line per block and exits non-zero if any failed.
A ```bash block runs with ``bash -e -o pipefail`` in a scratch directory that links the repository's
``README.md``, ``configs``, ``benchmarks``, ``docs`` and ``.venv`` (the running interpreter's environment), with
that environment's ``bin`` first on ``PATH``: commands run as written from the repository root, and what they
write stays out of it.
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from tests._env import fresh_launch_env

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK_LIMIT_S = 90
BASH_LIMIT_S = 240  # a command-line block may train a tiny model for a few hundred steps
_LANGS = ("python", "bash")
_LINKED = ("README.md", "configs", "benchmarks", "docs")
_SKIP = re.compile(r"^<!--\s*skip:\s*(\S.*?)\s*-->$")
_CONTINUED = "<!-- continued -->"


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason given in the skip comment
    lang: str = "python"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def collect(path: Path) -> list[Snippet]:
    """The ```python and ```bash blocks of one Markdown file, with the skip reason of each (``None``: it runs)."""
    lines = path.read_text().splitlines()
    snippets, index, bases = [], 0, {}
    while index < len(lines):
        fence = lines[index].strip()
        if fence.startswith("```") and fence[3:] in _LANGS:
            lang = fence[3:]
            start = index
            end = next((j for j in range(start + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"{path}:{start + 1}: a ```{lang} block that is never closed")
            previous = lines[start - 1].strip() if start else ""
            match = _SKIP.match(previous)
            continued = previous == _CONTINUED
            if previous.startswith("<!--") and match is None and not continued:
                raise ValueError(
                    f"{path}:{start}: a comment before a code block must read <!-- skip: REASON --> or {_CONTINUED}"
                )
            code = "\n".join(lines[start + 1 : end]) + "\n"
            if continued:
                if lang not in bases:
                    raise ValueError(f"{path}:{start + 1}: {_CONTINUED} with no {lang} block before it to continue")
                code = bases[lang].code + "\n" + code
            snippet = Snippet(path, start + 1, code, match.group(1) if match else None, lang)
            if not continued:
                bases[lang] = snippet
            snippets.append(snippet)
            index = end + 1
        else:
            index += 1
    return snippets


def collect_all() -> list[Snippet]:
    return [snippet for page in PAGES if "_build" not in page.parts for snippet in collect(page)]


def _on_alarm(signum, frame):
    raise TimeoutError(f"the block ran past {BLOCK_LIMIT_S} s")


def run(snippets: list[Snippet]) -> list[str]:
    """Run each snippet; the names (and tracebacks) of those that failed."""
    failures = []
    signal.signal(signal.SIGALRM, _on_alarm)
    with tempfile.TemporaryDirectory(prefix="doc-snippets-") as scratch:
        for number, snippet in enumerate(snippets):
            workdir = Path(scratch) / f"block{number}"
            workdir.mkdir()
            if snippet.lang == "bash":
                failures += _run_bash(snippet, workdir)
                continue
            script = workdir / "snippet.py"
            script.write_text(snippet.code)
            os.chdir(workdir)
            start = time.perf_counter()
            signal.alarm(BLOCK_LIMIT_S)
            try:
                runpy.run_path(str(script), run_name="__main__")
                status = "ok"
            except BaseException:  # SystemExit and KeyboardInterrupt too: a snippet must not end the run
                status = "FAILED"
                failures.append(f"{snippet.name}\n{traceback.format_exc()}")
            finally:
                signal.alarm(0)
                os.chdir(ROOT)
            print(f"{status:6} {time.perf_counter() - start:6.1f} s  {snippet.name}", flush=True)
    return failures


def _run_bash(snippet: Snippet, workdir: Path) -> list[str]:
    """Run one ```bash block as written from the repository root (see the module docstring); its failure, if any."""
    for name in _LINKED:
        (workdir / name).symlink_to(ROOT / name)
    (workdir / ".venv").symlink_to(Path(sys.prefix))
    (workdir / "snippet.sh").write_text(snippet.code)
    # A fresh shell's environment: not the rendezvous variables an earlier in-process block's Trainer set (its store
    # may still hold that port).
    env = fresh_launch_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    start = time.perf_counter()
    try:
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "snippet.sh"],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=BASH_LIMIT_S,
        )
        failed = result.returncode != 0
        detail = f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    except subprocess.TimeoutExpired:
        failed, detail = True, f"the block ran past {BASH_LIMIT_S} s"
    print(f"{'FAILED' if failed else 'ok':6} {time.perf_counter() - start:6.1f} s  {snippet.name}", flush=True)
    return [f"{snippet.name}\n{detail}"] if failed else []


def main() -> int:
    snippets = collect_all()
    runnable = [s for s in snippets if s.skip is None]
    for snippet in snippets:
        if snippet.skip is not None:
            print(f"skip            {snippet.name} ({snippet.skip})")
    failures = run(runnable)
    for failure in failures:
        print(f"\n--- {failure}", file=sys.stderr)
    print(
        f"{len(runnable) - len(failures)} of {len(runnable)} runnable blocks passed; {len(snippets) - len(runnable)} skipped"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
