"""Throughput of pipeline parallelism (pp=2, 8 micro-batches) against one rank, and the measured bubble.

Both run in this one invocation, one thread per rank, on the same model and global batch. The
measured bubble is 1 - T1m / (p * Tpp), with T1m one rank's time for the same m micro-batches
(gradient accumulation): the share of each pipeline rank's step not spent on its half of the work.
It includes point-to-point communication and stage imbalance, next to the schedule's ideal
(p - 1) / (m + p - 1).

    python benchmarks/pipeline_throughput.py --preset small --schedule 1F1B --microbatches 8
"""

from __future__ import annotations

import argparse
import statistics

import lightning as L
import torch

from _timing import StepTimer
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed


def fit(world_size: int, preset: str, schedule: str, microbatches: int, steps: int, batch: int, seq_len: int,
        accumulate: int = 1) -> float:
    torch.manual_seed(0)
    strategy = (
        LLMParallelStrategy(pipeline_parallel_size=world_size, pipeline_schedule=schedule, num_microbatches=microbatches)
        if world_size > 1 else LLMParallelStrategy()
    )
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        limit_val_batches=0, accumulate_grad_batches=accumulate,
    )
    trainer.fit(CausalLM(preset), LLMDataModule(num_tokens=400_000, seq_len=seq_len, batch_size=batch // accumulate))
    # A step is `accumulate` batches: sum each optimizer step's micro-batch times.
    per_step = [sum(timer.times[i : i + accumulate]) for i in range(0, len(timer.times), accumulate)]
    return statistics.median(per_step[3:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    common = (args.preset, args.schedule, args.microbatches, args.steps, args.batch, args.seq_len)
    t1 = run_distributed(fit, 1, 1, *common, timeout=1200)[0]
    t1_micro = run_distributed(fit, 1, 1, *common, args.microbatches, timeout=1200)[0]
    tpp = run_distributed(fit, 2, 2, *common, timeout=1200)[0]
    p, m = 2, args.microbatches
    tokens = args.batch * args.seq_len
    print(f"preset={args.preset}, global batch {args.batch} x {args.seq_len} tokens, one thread per rank")
    print(f"1 rank:          {t1 * 1e3:8.1f} ms/step  {tokens / t1:9.0f} tokens/s")
    print(f"pp=2 {args.schedule:>8} m={m}: {tpp * 1e3:8.1f} ms/step  {tokens / tpp:9.0f} tokens/s  speed-up {t1 / tpp:.2f}x")
    print(f"1 rank, m={m} micro-batches accumulated: {t1_micro * 1e3:8.1f} ms/step (the pipeline's per-rank work is half this)")
    print(f"bubble: measured {1 - t1_micro / (p * tpp):.3f} against micro-batched work "
          f"({1 - t1 / (p * tpp):.3f} against the whole batch), ideal (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}")


if __name__ == "__main__":
    main()
