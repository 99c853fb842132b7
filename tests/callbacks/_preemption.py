"""Driver for tests/callbacks/test_preemption.py: a straight run, a run that takes SIGTERM, and its relaunch.

    python _preemption.py WORKDIR MAX_STEPS RANK:STEP[,RANK:STEP] [--ranks 2] [--async_save] [--signal SIGUSR1]

``RANK:STEP`` sends SIGTERM (or ``--signal``, which CheckpointRotation then also takes) to that rank's own process at the end of that optimizer step (a real signal, delivered
by the OS; several ranks may take it at different steps). Each fit writes its final weights (rank 0, whole tensors)
to WORKDIR and prints a JSON line: the step reached, the seconds from the first signal to the end of ``fit``, and
whether it was preempted.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.checkpointing.files import complete_checkpoints
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy


class SigtermAt(L.Callback):
    """Sends ``signum`` to this rank's process at its step; notes the wall time in ``{stamp}.{rank}`` for rank 0."""

    def __init__(self, steps: dict[int, int], stamp: str, signum: int) -> None:
        self.steps, self.stamp, self.signum = steps, stamp, signum

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.steps.get(trainer.global_rank) == trainer.global_step:
            with open(f"{self.stamp}.{trainer.global_rank}", "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), self.signum)

    def first_signal(self) -> float | None:
        stamps = [Path(f"{self.stamp}.{rank}") for rank in self.steps]
        times = [float(p.read_text()) for p in stamps if p.exists()]
        return min(times, default=None)


def train(
    directory: Path, max_steps: int, out: Path, steps: dict[int, int], ranks: int, async_save: bool, name: str
) -> None:
    """One ``fit`` to ``max_steps`` (from the newest checkpoint in ``directory``, if any); prints its JSON report."""
    L.seed_everything(0)
    sigterm = SigtermAt(steps, f"{out}.signal", getattr(signal, name))
    rotation = CheckpointRotation(
        dirpath=str(directory),
        every_n_train_steps=4,
        keep_last=2,
        async_save=async_save,
        preemption_signals=sorted({"SIGTERM", name}),
    )
    layout = dict(devices=2, strategy=LLMParallelStrategy(zero_stage=3)) if ranks == 2 else {}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rotation, sigterm],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **layout,
    )
    module = CausalLM("tiny", warmup_steps=2)
    trainer.fit(module, LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4), ckpt_path="last")
    ended = time.time()
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()
    }
    if trainer.is_global_zero:
        torch.save(weights, out)
        first = sigterm.first_signal()
        seconds = None if first is None else ended - first
        report = {"step": trainer.global_step, "seconds_after_signal": seconds, "preempted": rotation.preempted}
        report["committed"] = [Path(c).name for c in complete_checkpoints(directory)]
        print(json.dumps(report), flush=True)


def main() -> None:
    """Three fits in one process tree (process start-up dominates these runs): a straight one to MAX_STEPS; one
    into a new directory that takes the signals; the relaunch of that one, from its newest checkpoint."""
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("max_steps", type=int)
    parser.add_argument("signals")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--async_save", action="store_true")
    parser.add_argument("--signal", default="SIGTERM")
    args = parser.parse_args()
    steps = {int(r): int(s) for r, s in (item.split(":") for item in args.signals.split(","))}
    torch.set_num_threads(1)
    common = dict(ranks=args.ranks, async_save=args.async_save, name=args.signal)
    train(args.workdir / "straight", args.max_steps, args.workdir / "straight.pt", {}, **common)
    train(args.workdir / "run", args.max_steps, args.workdir / "stopped.pt", steps, **common)
    train(args.workdir / "run", args.max_steps, args.workdir / "resumed.pt", {}, **common)


if __name__ == "__main__":
    main()
