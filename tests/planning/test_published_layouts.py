"""Layouts that trained at scale on 80GB H100s must be planned as fitting them (issue 47).

The oracle is the runs themselves: Llama 3 405B (TP8 x PP16 at 8K tokens, CP16 at 128K) on 16,384 H100s,
torchtitan's 405B (FSDP8 x TP8 x PP8) on 512 and Llama 3 8B with FSDP on 8 trained, so a planner that refuses any of
them, or needs offload for it, is wrong. ``benchmarks/published_layouts.py`` prints the table that ``docs/plan.md``
shows.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_published_layouts_fit_80gb_h100s_without_offload():
    result = subprocess.run(
        [sys.executable, "benchmarks/published_layouts.py"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| [\d x]+ \| (none|selective|full) \| (\d) \| ([\d.]+) \|$", result.stdout, re.M)
    assert len(rows) == 4, result.stdout
    usable = 81_559 / 1024 * 0.9  # an H100's 79.6 GiB less the planner's 10% margin
    for name, _mode, _stage, total in rows:
        assert float(total) <= usable, (name, total)
    # 128K tokens fit only because context parallelism divides the sequence: 16x the tokens of the 8K run.
    assert {name: mode for name, mode, _, _ in rows}["Llama 3 405B, 16,384 H100s, 128K"] != "none"
