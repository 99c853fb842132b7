"""MFU of the reference model through Trainer + LLMParallelStrategy + MFUMonitor against a raw PyTorch loop.

Both train the same Llama at the same batch, sequence length, optimizer (AdamW, fused on GPU),
precision (autocast bf16 with fp32 weights, or fp32), SDPA attention, activation checkpointing and
torch.compile settings, in one process, alternating rounds. Prints tokens/s, MFU, peak memory and
the throughput ratio (raw / Lightning; 1.00 means no overhead).

    python benchmarks/mfu.py --size 1B --device cuda --precision bf16-mixed --ac selective --compile
    python benchmarks/mfu.py --size 1B --device cuda --precision bf16-mixed --fp8 --markdown results.md
    python benchmarks/mfu.py --size tiny --device cpu --steps 6 --rounds 1     # CPU smoke test, same code path

``--fp8`` trains the blocks' Linear layers in fp8 (torchao float8, tensorwise) in both loops; MFU is
then still reported against the bf16 peak, so fp8's speed-up shows as a higher MFU. ``--loss`` picks the loss of
both loops: ``chunked`` (default, ``CausalLM``'s own: the head and the cross-entropy in chunks of tokens,
``lightning_llm.models.linear_cross_entropy``) or ``full`` (whole logits and ``F.cross_entropy``, the loss before
issue 51). ``--markdown FILE`` appends one table row per run (see ``benchmarks/gpu_suite.sh``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F

from lightning_llm.callbacks import MFUMonitor
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.models import CausalLM, Llama, LlamaConfig, linear_cross_entropy
from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_llm.parallel.float8 import apply_fp8
from lightning_llm.planning.flops import device_peak_flops
from lightning_llm.strategies import LLMParallelStrategy

SIZES = {"tiny": "tiny", "125M": "125M", "1B": "1B"}


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, seq_len: int, size: int = 100_000) -> None:
        self.vocab, self.seq_len, self.size = vocab, seq_len, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.seq_len + 1,), generator=torch.Generator().manual_seed(index))


class Timer(L.Callback):
    def __init__(self, device: torch.device) -> None:
        self.device, self.times, self._start = device, [], None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, *args) -> None:
        now = self._now()
        if self._start is not None:
            self.times.append(now - self._start)
        self._start = now


def lightning_run(args, config: LlamaConfig, device: torch.device) -> list[float]:
    timer = Timer(device)
    module = CausalLM(config, learning_rate=3e-4, warmup_steps=10, fused_cross_entropy=args.loss == "chunked")
    strategy = LLMParallelStrategy(activation_checkpointing=args.ac, compile_blocks=args.compile, fp8=args.fp8)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, MFUMonitor(log_every_n_steps=args.steps, peak_flops=args.peak_flops)],
        limit_val_batches=0,
    )
    loader = torch.utils.data.DataLoader(
        RandomTokens(config.vocab_size, args.seq_len),
        batch_size=args.batch,
        num_workers=2 if device.type == "cuda" else 0,
        pin_memory=device.type == "cuda",
    )
    trainer.fit(module, loader)
    return timer.times[args.warmup :]


def raw_run(args, config: LlamaConfig, device: torch.device) -> list[float]:
    model = Llama(config).to(device)
    if args.fp8:
        apply_fp8(model, blocks_name="layers")
    if args.ac != "none":
        apply_activation_checkpointing(list(model.layers), mode=args.ac)
    if args.compile:
        for block in model.layers:
            block.compile()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    dtype = torch.bfloat16 if args.precision.startswith("bf16") else None
    data = RandomTokens(config.vocab_size, args.seq_len)
    times, start = [], None
    for step in range(args.steps):
        now = Timer(device)._now()
        if start is not None:
            times.append(now - start)
        start = now
        batch = torch.stack([data[step * args.batch + i] for i in range(args.batch)]).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = raw_loss(model, batch, args.loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return times[args.warmup :]


def raw_loss(model: Llama, batch: torch.Tensor, loss: str) -> torch.Tensor:
    """The raw loop's loss, as CausalLM computes it: chunked through the head, or from the whole logits."""
    if loss == "chunked":
        hidden = model(batch[:, :-1], return_hidden=True)
        return linear_cross_entropy(hidden, model.output.weight, batch[:, 1:])
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peak-flops", type=float, default=None, help="per device; default: the peak table")
    parser.add_argument("--fp8", action="store_true", help="fp8 Linear layers in the blocks (torchao float8)")
    parser.add_argument("--loss", choices=("chunked", "full"), default="chunked", help="see the module docstring")
    parser.add_argument("--markdown", default=None, help="append a result row to this markdown file")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = LlamaConfig.from_name(SIZES[args.size], max_seq_len=args.seq_len)
    times, memory = {"lightning": [], "raw": []}, {"lightning": 0.0, "raw": 0.0}
    for _ in range(args.rounds):
        for name, run in (("lightning", lightning_run), ("raw", raw_run)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times[name] += run(args, config, device)
            if device.type == "cuda":
                memory[name] = max(memory[name], torch.cuda.max_memory_allocated() / 2**30)
                print(f"{name}: peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    with torch.device("meta"):
        flops_per_token = ModelShape.of(Llama(config)).flops_per_token(args.seq_len)
    peak = args.peak_flops or device_peak_flops(device, args.precision)  # bf16 peak also for --fp8 (see above)
    tokens = args.batch * args.seq_len
    print(
        f"size={args.size} ({config.n_layers} layers, dim {config.dim}), {args.device}, {args.precision}, ac={args.ac}, "
        f"compile={args.compile}, batch {args.batch} x {args.seq_len}, loss={args.loss}"
    )
    for name, values in times.items():
        step = statistics.median(values)
        mfu = f"{tokens / step * flops_per_token / peak:.4g}" if peak else "n/a (no peak FLOP/s for this device)"
        print(f"{name:>9}: {step * 1e3:9.1f} ms/step  {tokens / step:10.0f} tokens/s  MFU {mfu}")
    ratio = statistics.median(times["lightning"]) / statistics.median(times["raw"])
    print(f"ratio (Lightning step time / raw step time): {ratio:.3f}")
    if args.markdown:
        write_row(
            args,
            device,
            {n: tokens / statistics.median(v) for n, v in times.items()},
            flops_per_token,
            peak,
            memory,
            ratio,
        )


def write_row(args, device, tokens_per_s, flops_per_token, peak, memory, ratio) -> None:
    """Append this run as a row of the GPU suite's markdown table (header written when the file is new)."""
    import subprocess

    header = (
        "| device | commit | size | precision | fp8 | AC | compile | batch x seq | tokens/s | MFU | raw tokens/s "
        "| raw MFU | ratio | peak mem (GiB) | raw peak mem (GiB) | loss |\n" + "|---" * 16 + "|\n"
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    commit = (
        os.environ.get("GIT_COMMIT")
        or subprocess.run(  # GIT_COMMIT: a copy of the tree without .git
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )

    def mfu(n):
        return f"{tokens_per_s[n] * flops_per_token / peak:.1%}" if peak else "n/a"

    row = (
        f"| {name} | {commit or '?'} | {args.size} | {args.precision} | {args.fp8} | {args.ac} | {args.compile} | "
        f"{args.batch} x {args.seq_len} | {tokens_per_s['lightning']:.0f} | {mfu('lightning')} | "
        f"{tokens_per_s['raw']:.0f} | {mfu('raw')} | {ratio:.3f} | {memory['lightning']:.1f} | {memory['raw']:.1f} | "
        f"{args.loss} |\n"
    )
    new = not os.path.exists(args.markdown)
    with open(args.markdown, "a") as f:
        f.write((header if new else "") + row)


if __name__ == "__main__":
    main()
