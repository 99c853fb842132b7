"""fp8 vs bf16: the loss curve difference and tokens/s of the same run, same seed and data.

Trains the reference model twice through Trainer + LLMParallelStrategy, ``precision="bf16-mixed"``,
once as is and once with ``fp8=True`` (torchao float8, tensorwise), on the seeded synthetic Markov
corpus (a learnable chain, so the curves fall), and reports both final losses, the mean and max
absolute per-step loss difference over the last quarter of the run, and median tokens/s.

    python benchmarks/fp8_loss_curve.py --size 1B --steps 200 --seq-len 2048 --markdown results.md
    python benchmarks/fp8_loss_curve.py --size tiny --device cpu --steps 6 --seq-len 64   # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import lightning as L
import torch

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy


class Recorder(L.Callback):
    """Per-step loss (a host sync per step is fine here: this run measures curves, not overhead) and step times."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.losses, self.times, self._start = device, [], [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now


def run(args, fp8: bool) -> Recorder:
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = LlamaConfig.from_name(args.size, max_seq_len=args.seq_len)
    args.vocab = config.vocab_size
    recorder = Recorder(device)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        strategy=LLMParallelStrategy(fp8=fp8, compile_blocks=args.compile),
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        limit_val_batches=0,
    )
    tokens = args.steps * args.batch * (args.seq_len + 1) * 2
    data = LLMDataModule(num_tokens=tokens, vocab_size=args.vocab, seq_len=args.seq_len, batch_size=args.batch, seed=1)
    trainer.fit(CausalLM(config, learning_rate=3e-4, warmup_steps=max(1, args.steps // 10), max_steps=args.steps), data)
    return recorder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--markdown", default=None, help="append a result row to this markdown file")
    args = parser.parse_args()
    bf16, fp8 = run(args, fp8=False), run(args, fp8=True)
    tail = max(1, args.steps // 4)
    diffs = [abs(a - b) for a, b in zip(bf16.losses[-tail:], fp8.losses[-tail:])]
    tokens = args.batch * args.seq_len
    speed = {
        name: tokens / statistics.median(r.times[len(r.times) // 5 :] or r.times)
        for name, r in (("bf16", bf16), ("fp8", fp8))
    }
    print(f"size={args.size}, {args.device}, {args.steps} steps, batch {args.batch} x {args.seq_len}")
    print(f"final loss: bf16 {bf16.losses[-1]:.4f}  fp8 {fp8.losses[-1]:.4f}")
    print(f"|loss difference| over the last {tail} steps: mean {statistics.mean(diffs):.4f}  max {max(diffs):.4f}")
    print(f"tokens/s: bf16 {speed['bf16']:.0f}  fp8 {speed['fp8']:.0f}  speed-up {speed['fp8'] / speed['bf16']:.3f}")
    if args.markdown:
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        new = not os.path.exists(args.markdown)
        with open(args.markdown, "a") as f:
            if new:
                f.write(
                    "| device | size | steps | final loss bf16 | final loss fp8 | mean abs diff (last quarter) "
                    "| max abs diff | bf16 tokens/s | fp8 tokens/s | speed-up |\n" + "|---" * 10 + "|\n"
                )
            f.write(
                f"| {name} | {args.size} | {args.steps} | {bf16.losses[-1]:.4f} | {fp8.losses[-1]:.4f} | "
                f"{statistics.mean(diffs):.4f} | {max(diffs):.4f} | {speed['bf16']:.0f} | {speed['fp8']:.0f} | "
                f"{speed['fp8'] / speed['bf16']:.3f} |\n"
            )


if __name__ == "__main__":
    main()
