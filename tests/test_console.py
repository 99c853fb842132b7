"""What a new user's console prints: every line explained where they look first (README, "What the console
prints"), compared line by line to a checked-in expectation (tests/console/), and no warning the docs do not explain.

- The quick start, ``lightning-llm fit --config configs/tiny.yaml`` (20 steps here), on a machine where W&B was
  never configured: tests/console/quick_start.txt. Before: ``Epoch 0/-2``, ``Total FLOPs: 0`` and W&B's "anonymous
  setting has no effect" warning.
- A layout the strategy refuses, on 2 ranks: tests/console/refused_layout.txt, the error once (rank 0), without a
  traceback. Before: the same error and traceback once per rank, 85 lines.
- The fit of ``configs/tiny_tp2_zero3.yaml`` (tp2 + SP x ZeRO-3 on 4 processes, W&B offline, clipping, validation),
  with crash-safe checkpoints, stopped and resumed mid-epoch: every line of its console that reads like a warning
  must be one of :data:`EXPLAINED`.

Run-dependent parts (times, rates, losses, W&B run ids and versions) are normalized (:func:`console_lines`);
``UPDATE_CONSOLE=1`` rewrites the expectations from this machine's run.
"""

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._env import fresh_launch_env
from tests._optional import requires_wandb

ROOT = Path(__file__).resolve().parents[1]
WARNING_LIKE = re.compile(r"warn|deprecat|failed to load|suboptimal|will be removed", re.IGNORECASE)
EXPLAINED: tuple[str, ...] = ()  # W&B's "anonymous setting" warning is gone (the CLI drops Lightning's anonymous=None)
EXPECTED = Path(__file__).parent / "console"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
NORMALIZE = [  # what differs from run to run and machine to machine, then what it becomes
    (re.compile(r"offline-run-\d{8}_\d{6}-\w+"), "offline-run-<id>"),
    (re.compile(r"wandb version \S+"), "wandb version <version>"),
    (re.compile(r"v_num: \S+"), "v_num: <id>"),
    (re.compile(r"\d+:\d\d:\d\d"), "<time>"),
    (re.compile(r"[\d.]+it/s"), "<rate>"),
    (re.compile(r"(loss: )[\d.]+"), r"\1<loss>"),
    (re.compile(r"━+"), "━"),
    (re.compile(r"GPU available: \w+"), "GPU available: <bool>"),
    (re.compile(r" {2,}"), " "),
]


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


def console_lines(output: str) -> list[str]:
    """The console's lines as a user reads them, with the run-dependent parts normalized."""
    lines = []
    for line in ANSI.sub("", output).splitlines():
        for pattern, replacement in NORMALIZE:
            line = pattern.sub(replacement, line)
        if line.strip():
            lines.append(line.strip())
    return lines


def _compare(name: str, lines: list[str], ordered: bool = True) -> None:
    path = EXPECTED / f"{name}.txt"
    if os.environ.get("UPDATE_CONSOLE"):
        path.write_text("\n".join(lines) + "\n")
    expected = path.read_text().splitlines()
    got, want = (lines, expected) if ordered else (sorted(lines), sorted(expected))
    assert got == want, "\n".join(difflib.unified_diff(want, got, str(path), "this run", lineterm=""))


def _cli(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # A machine where W&B was never configured (no WANDB_*, no ~/.netrc): the quick start's conditions.
    env = {k: v for k, v in fresh_launch_env(OMP_NUM_THREADS="1").items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), COLUMNS="200", PYTHONUNBUFFERED="1")  # one bar line; lines in the order printed
    env.pop("NETRC", None)
    command = [sys.executable, "-m", "lightning_llm.cli", *args]
    return subprocess.run(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )


@requires_wandb
@pytest.mark.timeout(400)
def test_the_quick_starts_console_is_the_documented_one(tmp_path):
    result = _cli(tmp_path, "fit", "--config", str(ROOT / "configs/tiny.yaml"), "--trainer.max_steps", "20",
                  "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "2")  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    _compare("quick_start", console_lines(result.stdout))
    saved = list((tmp_path / "runs" / "wandb").glob("offline-run-*/config.yaml"))
    assert len(saved) == 1, "the resolved config is saved in the run's own directory"


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_refused_layout_on_two_ranks_prints_its_error_once(tmp_path):
    args = ["fit", "--config", str(ROOT / "configs/tiny.yaml"), "--trainer.devices", "2", "--trainer.logger", "false"]
    args += ["--trainer.strategy", "LLMParallelStrategy", "--trainer.strategy.tensor_parallel_size", "4"]
    result = _cli(tmp_path, *args)
    assert result.returncode == 1, result.stdout[-4000:]
    lines = console_lines(result.stdout)
    assert sum("error:" in line for line in lines) == 1 and not any("Traceback" in line for line in lines)
    _compare("refused_layout", lines, ordered=False)  # the two ranks' lines interleave in any order
