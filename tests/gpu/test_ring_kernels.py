"""Ring attention's per-block kernels on each device: SDPA's own kernels with their log-sum-exp, merged exactly.

At ``C = 1`` the ring holds its rank's two zig-zag chunks and runs three blocks (two causal diagonals, one full
block) merged by log-sum-exp, forward and backward, with no process group: what a CUDA ring runs per block
(flash for bf16, memory-efficient attention for fp32), without the send/recv that gloo tests prove on CPU. The
oracle is plain attention in float64 on the CPU. The CPU cases run everywhere; the CUDA ones are marked ``gpu``.
"""

import pytest
import torch

from lightning_llm.parallel.cp import CPGroup, ring_attention

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32-flash"),
    pytest.param("cuda", torch.float32, id="cuda-fp32-efficient", marks=[pytest.mark.gpu, CUDA]),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16-flash", marks=[pytest.mark.gpu, CUDA]),
]


def _reference(q, k, v, *, causal: bool):
    """Attention by its definition, float64 on the CPU, key/value heads repeated for GQA."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(groups, 1)
    return out, (q, k, v)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("device, dtype", CASES)
def test_ring_blocks_merge_to_attention_forward_and_backward(device, dtype, causal):
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 256, 64
    q = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)

    out = ring_attention(q, k, v, CPGroup(None, 1, 0), is_causal=causal)
    out.backward(grad)
    ref, leaves = _reference(q, k, v, causal=causal)
    ref.backward(grad.cpu().double())

    # SDPA itself at this dtype and device is the bar: the ring may be off by rounding, not by more.
    with torch.no_grad():
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    bar = max((sdpa.cpu().double() - ref).abs().max().item(), 1e-6)
    assert out.dtype == dtype and out.device.type == device
    assert (out.cpu().double() - ref).abs().max().item() <= 4 * bar + 1e-5
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for name, mine, theirs in zip("qkv", (q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        scale = theirs.abs().max().item()
        err = (mine.cpu().double() - theirs).abs().max().item()
        assert err <= tol * scale, f"d{name}: {err:.3g} off, {tol * scale:.3g} allowed ({device}, {dtype})"
