"""Fault-injection driver: train with a save every step, SIGKILL the trainer at random moments, check the directory.

A parent process imports everything once and forks a trainer child per round (fork keeps each
round to well under a second). Rounds alternate between synchronous saves and asynchronous ones
(a background writer thread), both with keep_last=1, the setting that lost the only complete
checkpoint in Megatron-Bridge #4678. The rounds start from one complete checkpoint; after each kill
the parent checks that complete checkpoints load and that at least one is left. The last round must
resume from "last" and finish. Prints a JSON report. Run by tests/callbacks/test_checkpoint_faults.py.
"""

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"

import lightning as L
import torch

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.checkpointing.files import complete_checkpoints, verify
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig


def train(directory: Path, steps: int, async_save: bool) -> None:
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            CheckpointRotation(dirpath=str(directory), every_n_train_steps=1, keep_last=1, async_save=async_save)
        ],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    # ~7M parameters: a ~90 MB checkpoint (with AdamW state), so most of each step is spent saving,
    # where the kills should land.
    config = LlamaConfig.from_name("small", dim=384, n_heads=6, n_kv_heads=2)
    trainer.fit(
        CausalLM(config, warmup_steps=1), LLMDataModule(num_tokens=40_000, seq_len=32, batch_size=2), ckpt_path="last"
    )


def _wait_for_save(directory: Path, since: float, timeout: float) -> None:
    """Until a save of this round has begun: a temporary entry newer than ``since`` (not an old leftover)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if any(p.name.startswith(".tmp-step") and p.stat().st_mtime > since for p in directory.iterdir()):
                return
        except FileNotFoundError:  # the directory or an entry vanished while looking
            pass
        time.sleep(0.002)


def _save_duration(directory: Path) -> float:
    """Seconds from a save's first written byte to its commit marker, measured on one uninterrupted run.

    The kills are spread over this span, so they land in every phase of a save (write, verification,
    checksums, rename, marker, rotation) however fast or loaded the machine is. The run's last checkpoint
    stays: the rounds resume from it, and every kill must leave a complete checkpoint behind. (Starting
    from an empty directory left that to chance: in some runs no killed round ever completed a save, so
    there was nothing to protect and nothing to resume.)
    """
    started = time.time()
    pid = os.fork()
    if pid == 0:
        try:
            train(directory, steps=2, async_save=False)
        finally:
            os._exit(0)
    _wait_for_save(directory, since=started, timeout=60)
    begun = time.monotonic()
    while not any(p.name.endswith(".meta.json") for p in directory.iterdir()) and time.monotonic() < begun + 60:
        time.sleep(0.002)
    duration = time.monotonic() - begun
    os.waitpid(pid, 0)
    return duration


def main(directory: str, kills: int, budget_s: float, seed: int) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    window = 1.2 * _save_duration(directory)
    rng = random.Random(seed)
    report = {
        "kills": 0,
        "async_kills": 0,
        "killed_mid_save": 0,
        "violations": [],
        "max_complete": 0,
        "resumed_to_step": None,
        "kill_window_s": round(window, 3),
        "rounds_that_committed": 0,
    }
    had_complete = bool(complete_checkpoints(directory))
    if not had_complete:
        report["violations"].append("the uninterrupted run left no complete checkpoint")
    deadline = time.monotonic() + budget_s
    while report["kills"] < kills and time.monotonic() < deadline:
        started, before = time.time(), complete_checkpoints(directory)
        async_save = report["kills"] % 2 == 1
        pid = os.fork()
        if pid == 0:
            try:
                train(directory, steps=10_000, async_save=async_save)
            finally:
                os._exit(0)
        # Wait for a save to start (its temporary entry appears), then kill at a random point of it:
        # inside the write, the verification, the checksums, the rename, the marker or the rotation.
        _wait_for_save(directory, since=started, timeout=20)
        time.sleep(rng.uniform(0.0, window))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        report["kills"] += 1
        report["async_kills"] += async_save
        complete = complete_checkpoints(directory)
        # The kill landed inside a save if it left a temporary or unmarked entry, or a committed
        # checkpoint whose older sibling was not yet rotated away (keep_last=1).
        leftovers = [
            p
            for p in directory.glob("*")
            if not p.name.endswith(".meta.json")
            and (p.name.startswith(".") or not Path(str(p) + ".meta.json").exists())
        ]
        report["killed_mid_save"] += bool(leftovers) or len(complete) > 1
        for path in complete:
            try:
                verify(path, trial_load=True)
            except Exception as err:
                report["violations"].append(f"kill {report['kills']}: {Path(path).name} marked complete but {err}")
        if had_complete and not complete:
            report["violations"].append(f"kill {report['kills']}: no complete checkpoint left")
        report["rounds_that_committed"] += bool(set(complete) - set(before))
        had_complete = had_complete or bool(complete)
        report["max_complete"] = max(report["max_complete"], len(complete))
    if not complete_checkpoints(directory):
        report["violations"].append("no complete checkpoint to resume from")
        print(json.dumps(report))
        return
    last = complete_checkpoints(directory)[-1]
    step = json.loads(Path(str(last) + ".meta.json").read_text())["step"]
    pid = os.fork()
    if pid == 0:
        try:
            train(directory, steps=step + 2, async_save=True)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    final = complete_checkpoints(directory)
    if status == 0 and final:
        report["resumed_to_step"] = json.loads(Path(str(final[-1]) + ".meta.json").read_text())["step"]
    report["resumed_from_step"] = step
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
