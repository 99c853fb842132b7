"""Throughput of pipeline parallelism against one rank, and the measured bubble, per schedule.

Every configuration is a separate launch of CPU ranks (one thread each) on the same model and global
batch; the launches of one round run in a shuffled order and the rounds repeat, so each figure is a
per-round ratio quoted as median (min, max). Per pipeline configuration:

- speed-up against one rank running the whole batch at once, ``T1 / Tpp``;
- the measured bubble ``1 - T1m / (p * Tpp)``, with ``T1m`` one rank's time for the same m micro-batches
  (gradient accumulation): the share of each pipeline rank's step not spent on its 1/p of the work. It
  includes point-to-point communication and stage imbalance, next to the schedule's ideal
  ``(p - 1) / (m + p - 1)`` (``(p - 1) / (v * m + p - 1)`` for v stages per rank).

p ranks on fewer than p cores are oversubscribed: their figures measure CPU contention, not the schedule.

    python benchmarks/pipeline_throughput.py --schedules 1F1B --pp 2 --microbatches 8 --rounds 5 --contention
    python benchmarks/pipeline_throughput.py --schedules GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble --pp 2,4 \\
        --microbatches 8,16 --layers 8 --rounds 3
    python benchmarks/pipeline_throughput.py --schedules 1F1B,Interleaved1F1B --pp 2 --microbatches 8 --rounds 3 \\
        --contention --breakdown
    python benchmarks/pipeline_throughput.py --schedules 1F1B,ZBVZeroBubble --pp 2 --microbatches 8 --seq-len 512 \\
        --steps 10 --rounds 5 --contention      # micro-batches big enough to keep a rank busy
    python benchmarks/pipeline_throughput.py --quick     # CI smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

import torch
from _pipeline_breakdown import StageBreakdown, format_breakdown
from _timing import StepTimer, alternate, median_after_warmup, ratios, spread

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed

WARMUP = 3


def fit(
    world_size: int,
    config: LlamaConfig,
    schedule: str,
    microbatches: int,
    steps: int,
    batch: int,
    seq_len: int,
    accumulate: int = 1,
    breakdown: bool = False,
) -> float | dict:
    """Median optimizer-step time of one launch (``accumulate`` > 1: one rank doing micro-batches in turn);
    with ``breakdown``, this rank's step by part instead (:mod:`_pipeline_breakdown`)."""
    torch.manual_seed(0)
    strategy = (
        LLMParallelStrategy(
            pipeline_parallel_size=world_size, pipeline_schedule=schedule, num_microbatches=microbatches
        )
        if world_size > 1
        else LLMParallelStrategy()
    )
    timer = StepTimer()
    parts = StageBreakdown(WARMUP) if breakdown else None
    trainer = cpu_trainer(
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        callbacks=[timer, *([parts] if parts else [])],
        limit_val_batches=0,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(CausalLM(config), LLMDataModule(num_tokens=400_000, seq_len=seq_len, batch_size=batch // accumulate))
    if parts is not None:
        return {**parts.result(), "stages": [list(c.blocks) for c in trainer.strategy.report.chunks]}
    # A step is `accumulate` batches: sum each optimizer step's micro-batch times.
    per_step = [sum(timer.times[i : i + accumulate]) for i in range(0, len(timer.times), accumulate)]
    return median_after_warmup(per_step, WARMUP)


def _launch(side: str, config: LlamaConfig, args) -> float:
    """Sides: ``one`` (whole batch), ``one/m8`` (8 accumulated micro-batches), ``pp2/1F1B/m8``, and
    ``pair/m8``: two independent one-rank ``one/m8`` runs at once (the slower one's time), which measures
    what running two busy ranks costs each of them on this machine (shared memory bandwidth and caches)."""
    parts = side.split("/")
    common = (config, "1F1B", 1, args.steps, args.batch, args.seq_len)
    if parts[0] == "pair":
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(run_distributed, fit, 1, 1, *common, int(parts[1][1:]), timeout=1200) for _ in range(2)]
            return max(run.result()[0] for run in runs)
    if parts[0] == "one":
        accumulate = int(parts[1][1:]) if len(parts) > 1 else 1
        return run_distributed(fit, 1, 1, *common, accumulate, timeout=1200)[0]
    pp, schedule, m = int(parts[0][2:]), parts[1], int(parts[2][1:])
    return run_distributed(fit, pp, pp, config, schedule, m, args.steps, args.batch, args.seq_len, timeout=1200)[0]


def _ideal_bubble(pp: int, m: int, schedule: str) -> float:
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    return (pp - 1) / (stages_per_rank * m + pp - 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of blocks")
    parser.add_argument("--schedules", default="1F1B")
    parser.add_argument("--pp", default="2")
    parser.add_argument("--microbatches", default="8")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--contention",
        action="store_true",
        help="also time two independent one-rank runs at once: the slow-down of each is the cost of "
        "sharing the machine, which no schedule can remove",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="after the rounds, one more launch of each pipeline with timers: each rank's step split "
        "into compute, head+loss, p2p wait, schedule and Lightning work (not in the timed rounds)",
    )
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny preset, 6 steps, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.rounds, args.batch, args.seq_len = "tiny", 6, 2, 8, 32
    config = LlamaConfig.from_name(args.preset, **({"n_layers": args.layers} if args.layers else {}))
    pps, ms = [int(p) for p in args.pp.split(",")], [int(m) for m in args.microbatches.split(",")]
    pipelines = [f"pp{p}/{s}/m{m}" for s in args.schedules.split(",") for p in pps for m in ms]
    sides = ["one", *[f"one/m{m}" for m in ms], *pipelines, *([f"pair/m{m}" for m in ms] if args.contention else [])]
    times = alternate(sides, lambda side: _launch(side, config, args), args.rounds)

    cores = len(os.sched_getaffinity(0))
    tokens = args.batch * args.seq_len
    print(
        f"preset={args.preset} ({config.n_layers} blocks), global batch {args.batch} x {args.seq_len} tokens, "
        f"one thread per rank, {cores} cores, {args.rounds} rounds, {args.steps} steps per launch"
    )
    one = statistics.median(times["one"])
    print(f"one rank: {one * 1e3:.1f} ms/step, {tokens / one:.0f} tokens/s (median)")
    for m in ms:  # cutting the batch costs matmul efficiency before any pipelining: p ranks reach at most p * T1 / T1m
        cut = ratios(times["one"], times[f"one/m{m}"])
        print(
            f"one rank, {m} micro-batches in turn: {statistics.median(times[f'one/m{m}']) * 1e3:.1f} ms/step; "
            f"T1/T1m {spread(cut, 3)}"
        )
    if args.contention:
        for m in ms:
            slowdown = ratios(times[f"pair/m{m}"], times[f"one/m{m}"])
            print(
                f"two one-rank runs at once (m={m}): each {spread(slowdown, 2)}x slower than alone, so p=2 ranks "
                f"can reach at most {2 / statistics.median(slowdown):.2f}x before any bubble"
            )
    for side in pipelines:
        pp, schedule, m = int(side.split("/")[0][2:]), side.split("/")[1], int(side.split("/")[2][1:])
        step = statistics.median(times[side])
        bubble = [1 - t1m / (pp * t) for t1m, t in zip(times[f"one/m{m}"], times[side], strict=True)]
        note = "  (oversubscribed: more ranks than cores)" if pp > cores else ""
        print(
            f"{side}: {step * 1e3:.1f} ms/step, {tokens / step:.0f} tokens/s; speed-up over one rank "
            f"{spread(ratios(times['one'], times[side]), 2)}; bubble {spread(bubble, 3)}, ideal "
            f"{_ideal_bubble(pp, m, schedule):.3f}{note}"
        )
    if args.breakdown:
        for side in pipelines:
            pp, schedule, m = int(side.split("/")[0][2:]), side.split("/")[1], int(side.split("/")[2][1:])
            ranks = run_distributed(
                fit, pp, pp, config, schedule, m, args.steps, args.batch, args.seq_len, 1, True, timeout=1200
            )
            print("\n" + format_breakdown(side, ranks))
            print(f"blocks per rank's stages: {[r['stages'] for r in ranks]}")


if __name__ == "__main__":
    main()
