"""The chunked linear cross-entropy on each device: bf16 under autocast against ``F.cross_entropy`` on whole logits,
and its peak memory against those logits.

Oracles: ``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` in fp32 (the truth) and under the same
autocast (what the model computed before): the chunked loss's error from the truth must stay within twice the plain
path's own bf16 error. Memory: CUDA's allocator peak on the GPU, torch's ``MemTracker`` on the CPU. The CPU cases run
everywhere (small shapes; tests/models/test_cross_entropy.py holds the full-size CPU memory bound); the CUDA ones are
marked ``gpu``, at a 128K vocabulary and 4K tokens, with Liger's kernel too where ``liger-kernel`` is installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from lightning_llm.models import linear_cross_entropy

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LIGER = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
GPU = [pytest.mark.gpu, CUDA]
# (device, implementation, tokens, dim, vocab)
CASES = [
    pytest.param("cpu", "torch", 2048, 32, 8192, id="cpu-torch"),
    pytest.param("cuda", "torch", 4096, 256, 128_256, id="cuda-torch", marks=GPU),
    pytest.param("cuda", "liger", 4096, 256, 128_256, id="cuda-liger", marks=[*GPU, LIGER]),
]


def _inputs(device: str, tokens: int, dim: int, vocab: int):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=generator) / dim**0.5).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    targets[::7] = -100
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, targets, autocast: bool):
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = fn(hidden, weight, targets)
    return [loss.detach().float(), *(g.float() for g in torch.autograd.grad(loss, (hidden, weight)))]


def _plain(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device, implementation, tokens, dim, vocab", CASES)
def test_bf16_loss_and_gradients_are_as_close_to_fp32_as_the_plain_path(device, implementation, tokens, dim, vocab):
    hidden, weight, targets = _inputs(device, tokens, dim, vocab)
    chunked = lambda h, w, t: linear_cross_entropy(h, w, t, implementation=implementation)  # noqa: E731
    got = _loss_and_grads(chunked, hidden, weight, targets, autocast=True)
    plain = _loss_and_grads(_plain, hidden, weight, targets, autocast=True)
    truth = _loss_and_grads(_plain, hidden, weight, targets, autocast=False)
    for name, a, b, want in zip(("loss", "hidden grad", "weight grad"), got, plain, truth):
        error, plain_error = (a - want).norm() / want.norm(), (b - want).norm() / want.norm()
        assert error <= max(2 * plain_error, 1e-3), (name, error.item(), plain_error.item())


def _peak_bytes(device: str, step) -> int:
    """The most bytes ``step`` held at once beyond what existed before it."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device, implementation, tokens, dim, vocab", CASES)
def test_bf16_peak_memory_stays_below_the_logits(device, implementation, tokens, dim, vocab):
    hidden, weight, targets = _inputs(device, tokens, dim, vocab)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, targets, implementation=implementation, chunk_size=tokens // 8)
        loss.backward()

    peak = _peak_bytes(device, step)
    logits = tokens * vocab * 2  # the bf16 logits alone; the plain path adds an fp32 copy and its log-softmax
    assert peak < logits, f"peak {peak / 2**20:.0f} MiB, bf16 logits {logits / 2**20:.0f} MiB"
