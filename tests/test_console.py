"""A new user's run prints no warning the docs do not explain (docs/troubleshooting.md, "What the console prints").

The fit of ``configs/tiny_tp2_zero3.yaml`` (tp2 + SP x ZeRO-3 on 4 processes, W&B offline, clipping, validation),
with crash-safe checkpoints, stopped and resumed mid-epoch: every line of its console that reads like a warning
must be one of :data:`EXPLAINED`.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._env import fresh_launch_env
from tests._optional import requires_wandb

ROOT = Path(__file__).resolve().parents[1]
WARNING_LIKE = re.compile(r"warn|deprecat|failed to load|suboptimal|will be removed", re.IGNORECASE)
EXPLAINED = ("wandb: WARNING The anonymous setting has no effect",)  # Lightning's WandbLogger passes anonymous=None


def _fit(tmp_path: Path, steps: int, *extra: str) -> str:
    command = [sys.executable, "-m", "lightning_llm.cli", "fit", "--config", str(ROOT / "configs/tiny_tp2_zero3.yaml")]
    command += ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", "2", "--trainer.limit_val_batches"]
    command += ["1", "--trainer.enable_progress_bar", "false", "--data.num_tokens", "20000", *extra]
    command += [
        "--trainer.enable_checkpointing",
        "true",
        "--trainer.callbacks+=lightning_llm.callbacks.CheckpointRotation",
    ]
    command += ["--trainer.callbacks.dirpath", "checkpoints", "--trainer.callbacks.every_n_train_steps", "2"]
    env = fresh_launch_env(OMP_NUM_THREADS="1", WANDB_MODE="offline")  # not this process's LOCAL_RANK...
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr


@requires_wandb
@pytest.mark.timeout(600)
def test_a_new_users_tp2_run_and_its_resume_print_no_unexplained_warning(tmp_path):
    output = _fit(tmp_path, 4) + _fit(tmp_path, 6, "--ckpt_path", "last")
    assert "Restored all states from the checkpoint" in output or "Restoring states from the checkpoint" in output
    unexplained = [
        line for line in output.splitlines() if WARNING_LIKE.search(line) and not line.strip().startswith(EXPLAINED)
    ]
    assert not unexplained, "\n".join(unexplained)
