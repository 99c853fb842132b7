"""Step-time cost of MFUMonitor + GradNormMonitor + LossSpikeGuard together, against none, in one run.

Two measures: (1) the time spent inside the callbacks' hooks, timed directly, as a share of the
step (precise); (2) runs alternating between both settings, the ratio of median step times
(includes everything): per round, the ratio of the two runs' median step times, reported as median
(min, max) over rounds run in a shuffled order.

    python benchmarks/callbacks_overhead.py --preset small --steps 30 --rounds 7
    python benchmarks/callbacks_overhead.py --quick     # CI smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from _timing import StepTimer, alternate, median_after_warmup, ratios, spread

from lightning_llm.callbacks import GradNormMonitor, LossSpikeGuard, MFUMonitor
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.testing import cpu_trainer

HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_before_optimizer_step")


def timed(callback: L.Callback, spent: list[float]) -> L.Callback:
    """Wrap the callback's per-step hooks so the time inside them adds up in ``spent``."""
    for name in HOOKS:
        hook = getattr(callback, name)

        def wrapper(*args, _hook=hook, **kwargs):
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        setattr(callback, name, wrapper)
    return callback


def run(preset: str, steps: int, monitored: bool, spent: list[float]) -> float:
    torch.manual_seed(0)
    timer = StepTimer()
    callbacks = [timer]
    if monitored:
        callbacks += [
            timed(c, spent) for c in (MFUMonitor(peak_flops=1e12), GradNormMonitor(), LossSpikeGuard(action="skip"))
        ]
    trainer = cpu_trainer(
        max_steps=steps,
        log_every_n_steps=10,
        callbacks=callbacks,
        limit_val_batches=0,
        gradient_clip_val=1.0,
    )
    trainer.fit(CausalLM(preset), LLMDataModule(num_tokens=300_000, seq_len=128, batch_size=8))
    return median_after_warmup(timer.times, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny preset, 8 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.rounds = "tiny", 8, 2
    spent: list[float] = []
    times = alternate(["off", "on"], lambda side: run(args.preset, args.steps, side == "on", spent), args.rounds)
    off = statistics.median(times["off"])
    in_hooks = sum(spent) / args.rounds / args.steps
    print(
        f"preset={args.preset}, CPU, {args.steps} steps per run, {args.rounds} rounds, "
        "MFUMonitor + GradNormMonitor + LossSpikeGuard:"
    )
    print(
        f"  time inside the callbacks: {in_hooks * 1e3:.2f} ms per step = {1 + in_hooks / off:.4f}x of a {off * 1e3:.1f} ms step"
    )
    print(f"  alternating runs, step-time ratio on/off: {spread(ratios(times['on'], times['off']))}")


if __name__ == "__main__":
    main()
