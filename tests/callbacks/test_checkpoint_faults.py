"""SIGKILL during saving, at least 50 times (sync and async saves): a complete checkpoint always survives and resume
works."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("_checkpoint_faults.py")


@pytest.mark.timeout(400)
def test_killed_saves_never_leave_zero_or_broken_checkpoints(tmp_path):
    result = subprocess.run(
        [sys.executable, str(DRIVER), str(tmp_path / "ckpt"), "50", "240", "0"],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["kills"] >= 50 and report["async_kills"] >= 25, report
    assert report["killed_mid_save"] >= 30, f"too few kills landed inside a save to mean much: {report}"
    assert report["violations"] == [], report["violations"]
    assert report["max_complete"] >= 1
    assert report["resumed_to_step"] == report["resumed_from_step"] + 2, report
