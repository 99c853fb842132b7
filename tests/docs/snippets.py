"""Collect the ```python blocks of the docs pages and the README, and run them on CPU.

A block runs unless the line right before its opening fence is an HTML comment ``<!-- skip: REASON -->``
(``needs GPU``, ``needs 8 devices``, ``long run``...): the reason is required, so a skipped block says why.
``<!-- continued -->`` there instead makes a block the continuation of the last block before it that is not
itself continued (a tutorial's definitions, then its runs): the two run together as one program.
``python -m tests.docs.snippets`` runs every runnable block, each in a fresh namespace of one interpreter, as
``__main__`` from a file of its own (so ``if __name__ == "__main__":`` and spawned processes work), in a scratch
directory, with a time limit per block; it prints one line per block and exits non-zero if any failed.
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK_LIMIT_S = 90
_SKIP = re.compile(r"^<!--\s*skip:\s*(\S.*?)\s*-->$")
_CONTINUED = "<!-- continued -->"


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason given in the skip comment

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def collect(path: Path) -> list[Snippet]:
    """The ```python blocks of one Markdown file, with the skip reason of each (``None``: it runs)."""
    lines = path.read_text().splitlines()
    snippets, index, base = [], 0, None
    while index < len(lines):
        if lines[index].strip() == "```python":
            start = index
            end = next((j for j in range(start + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ValueError(f"{path}:{start + 1}: a ```python block that is never closed")
            previous = lines[start - 1].strip() if start else ""
            match = _SKIP.match(previous)
            continued = previous == _CONTINUED
            if previous.startswith("<!--") and match is None and not continued:
                raise ValueError(
                    f"{path}:{start}: a comment before a code block must read <!-- skip: REASON --> or {_CONTINUED}"
                )
            code = "\n".join(lines[start + 1 : end]) + "\n"
            if continued:
                if base is None:
                    raise ValueError(f"{path}:{start + 1}: {_CONTINUED} with no block before it to continue")
                code = base.code + "\n" + code
            snippet = Snippet(path, start + 1, code, match.group(1) if match else None)
            base = base if continued else snippet
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
