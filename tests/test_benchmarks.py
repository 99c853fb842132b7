"""The MFU benchmark runs on CPU at tiny size through the same code path it uses on GPUs."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_mfu_benchmark_cpu_smoke():
    result = subprocess.run(
        [sys.executable, "benchmarks/mfu.py", "--size", "tiny", "--device", "cpu", "--precision", "32-true",
         "--seq-len", "64", "--batch", "4", "--steps", "6", "--warmup", "2", "--rounds", "1", "--peak-flops", "1e12"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for name in ("lightning", "raw"):
        match = re.search(rf"{name}:\s+([\d.]+) ms/step\s+(\d+) tokens/s\s+MFU ([\d.e-]+)", out)
        assert match, out
        step_ms, tokens_per_s, mfu = map(float, match.groups())
        assert step_ms > 0 and tokens_per_s > 0
        assert 0 < mfu < 1
    assert re.search(r"ratio \(Lightning step time / raw step time\): [\d.]+", out)
