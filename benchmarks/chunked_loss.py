"""The loss step alone at a model's head shapes: whole logits and ``F.cross_entropy`` against the chunked loss.

One forward and backward of the head and the loss on random hidden states (batch x seq tokens of the preset's
width, its vocabulary), under bf16 autocast with an fp32 weight as in training: the peak memory the step adds
(CUDA's allocator; on the CPU torch's ``MemTracker``) and its median time over a few repeats.

    python benchmarks/chunked_loss.py --size 1B --device cuda            # batch 4 x 2048, vocabulary 128256
    python benchmarks/chunked_loss.py --size tiny --device cpu --repeats 2  # CPU smoke test, same code path
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lightning_llm.models import LlamaConfig, linear_cross_entropy


def _full(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


def _chunked(hidden, weight, targets):
    return linear_cross_entropy(hidden, weight, targets)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(step, device: torch.device) -> int:
    """Bytes ``step`` held at its peak beyond what existed before it."""
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated() - before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def measure(loss_fn, hidden, weight, targets, repeats: int) -> tuple[int, float]:
    """(peak bytes, median seconds) of forward + backward of ``loss_fn`` under bf16 autocast."""
    device = hidden.device

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(hidden, weight, targets)
        loss.backward()
        hidden.grad = weight.grad = None

    step()  # warm-up (kernels, allocator)
    peak = peak_bytes(step, device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1B")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config, device = LlamaConfig.from_name(args.size), torch.device(args.device)
    tokens = args.batch * args.seq_len
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, config.dim, generator=generator).to(device).requires_grad_()
    weight = (0.02 * torch.randn(config.vocab_size, config.dim, generator=generator)).to(device).requires_grad_()
    targets = torch.randint(0, config.vocab_size, (tokens,), generator=generator).to(device)
    print(f"size={args.size}: {tokens} tokens, dim {config.dim}, vocabulary {config.vocab_size}, {device}")
    for name, fn in (("full", _full), ("chunked", _chunked)):
        peak, seconds = measure(fn, hidden, weight, targets, args.repeats)
        print(f"{name:>8}: peak {peak / 2**20:9.1f} MiB  {seconds * 1e3:8.1f} ms/step")


if __name__ == "__main__":
    main()
