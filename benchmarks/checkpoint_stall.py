"""How long a checkpoint save stalls training: synchronous against asynchronous CheckpointRotation, one run.

The stall is the time the training loop spends between the end of a step and the start of the next
one: Lightning runs checkpoint callbacks after all others, so a timer callback's ``on_train_batch_end``
marks the end of the step and its ``on_train_batch_start`` the moment training goes on. On steps
without a save this gap is ~0; on save steps it is the save's blocking part (sync: dump, write,
verify, commit, rotate; async: dump and the host copy). Also printed: the whole run's time per
mode, since on a CPU-only machine the background writer competes with training for the same cores.

One process by default (single-file saves, written by a background thread); with ``--ranks N``,
LLMParallelStrategy ZeRO 3 on N CPU ranks (sharded DCP saves, asynchronous through DCP's ``async_save``), each
rank's stall measured and the largest taken, since the next step waits for the slowest rank. The reference
Llama at a few widths (checkpoints of ~37, ~150 and ~600 MB in all with AdamW state). Per round, sync and async runs alternate in a shuffled order; each round's figure is the ratio of
the async run's median stall to the sync run's, over every save but the first: the first asynchronous
save allocates the reused host buffers (its stall is printed apart).

    python benchmarks/checkpoint_stall.py --sizes 37,150,600 --rounds 5
    python benchmarks/checkpoint_stall.py --sizes 37,150,600 --rounds 5 --ranks 2   # sharded DCP saves, ZeRO 3
    python benchmarks/checkpoint_stall.py --quick       # CI smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import lightning as L
import torch
from _timing import alternate, ratios, spread

from lightning_llm.callbacks import CheckpointRotation
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed


class StallTimer(L.Callback):
    """Gaps between the end of a step (before checkpoint callbacks run) and the start of the next."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._step_end: float | None = None

    def on_train_batch_end(self, *args) -> None:
        self._step_end = time.perf_counter()

    def on_train_batch_start(self, *args) -> None:
        if self._step_end is not None:
            self.gaps.append(time.perf_counter() - self._step_end)


# Checkpoint size in MB (weights + AdamW moments, fp32: 12 bytes per parameter) -> (width, blocks); the
# reference Llama with a 256-token vocabulary: 3.1M, 14.0M and 48.3M parameters.
SHAPES = {37: (256, 4), 150: (768, 4), 600: (1024, 9)}


def run(
    async_save: bool, saves: int, every: int, shape: tuple[int, int], directory: str | None = None, ranks: int = 1
) -> dict:
    """Stalls of each save but the last (the last has no next step to delay), plain step gaps, checkpoint MB.

    ``ranks`` > 1 (called on every rank, with a shared ``directory``): LLMParallelStrategy ZeRO 3, whose saves are
    sharded DCP checkpoints (``async_save`` through DCP's ``async_save`` and its reused stager).
    """
    if directory is None:
        with tempfile.TemporaryDirectory() as directory:
            return run(async_save, saves, every, shape, directory)
    torch.manual_seed(0)
    timer = StallTimer()
    rotation = CheckpointRotation(dirpath=directory, every_n_train_steps=every, keep_last=2, async_save=async_save)
    parallel = {"devices": ranks, "strategy": LLMParallelStrategy(zero_stage=3)} if ranks > 1 else {}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=saves * every,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rotation, timer],
        limit_val_batches=0,
        **parallel,
    )
    config = LlamaConfig.from_name("small", dim=shape[0], n_layers=shape[1], n_heads=8, n_kv_heads=4)
    start = time.perf_counter()
    trainer.fit(CausalLM(config), LLMDataModule(num_tokens=100_000, seq_len=64, batch_size=4))
    total = time.perf_counter() - start
    checkpoints = [e for e in os.scandir(directory) if e.name.endswith(".ckpt")]
    megabytes = sum(_size(e) for e in checkpoints) / 1e6 / max(1, len(checkpoints))
    saved = [gap for i, gap in enumerate(timer.gaps) if (i + 1) % every == 0]
    plain = statistics.median(gap for i, gap in enumerate(timer.gaps) if (i + 1) % every)
    return {"first": saved[0], "stall": statistics.median(saved[1:]), "plain": plain, "total": total, "mb": megabytes}


def _size(entry: os.DirEntry) -> int:
    """Bytes of a checkpoint: one file, or a sharded checkpoint's directory."""
    if entry.is_file():
        return entry.stat().st_size
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(entry.path) for name in names)


def _launch(async_save: bool, args, shape: tuple[int, int]) -> dict:
    if args.ranks == 1:
        return run(async_save, args.saves, args.every, shape)
    with tempfile.TemporaryDirectory() as directory:  # every rank's stall; training waits for the slowest
        ranks = run_distributed(
            run, args.ranks, async_save, args.saves, args.every, shape, directory, args.ranks, timeout=1800
        )
    return {**ranks[0], **{key: max(r[key] for r in ranks) for key in ("first", "stall", "plain", "total")}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="37,150,600", help=f"checkpoint sizes in MB, of {sorted(SHAPES)}")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument(
        "--every",
        type=int,
        default=6,
        help="steps between saves: enough for the previous background write to finish, else the "
        "next save waits for it and the stall includes that wait",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="more than 1: LLMParallelStrategy ZeRO 3 on that many CPU ranks (sharded DCP saves)",
    )
    parser.add_argument("--quick", action="store_true", help="CI smoke: 37 MB, 3 saves, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.saves, args.every, args.rounds = "37", 3, 4, 2
    for size in (int(s) for s in args.sizes.split(",")):
        results: dict[str, list[dict]] = {"sync": [], "async": []}

        def launch(mode: str) -> float:
            results[mode].append(_launch(mode == "async", args, SHAPES[size]))
            return results[mode][-1]["stall"]

        stalls = alternate(["sync", "async"], launch, args.rounds)
        mb = statistics.median(r["mb"] for r in results["sync"])
        first = statistics.median(r["first"] for r in results["async"])
        plain = max(r["plain"] for mode in results for r in results[mode])
        print(
            f"{mb:.0f} MB checkpoints ({args.ranks} rank{'s' if args.ranks > 1 else ''}), {args.rounds} rounds of {args.saves} saves: stall per save sync "
            f"{statistics.median(stalls['sync']) * 1e3:.0f} ms, async {statistics.median(stalls['async']) * 1e3:.1f} ms "
            f"(first async save {first * 1e3:.0f} ms: it allocates the host buffers); async/sync "
            f"{spread(ratios(stalls['async'], stalls['sync']))}; steps without a save {plain * 1e3:.1f} ms at most; "
            f"whole run sync {statistics.median(r['total'] for r in results['sync']):.1f} s, async "
            f"{statistics.median(r['total'] for r in results['async']):.1f} s"
        )


if __name__ == "__main__":
    main()
