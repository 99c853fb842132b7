"""Training FLOPs per token of a decoder LLM, and peak FLOP/s of accelerators.

Model FLOPs per token follow the PaLM / Chinchilla accounting torchtitan uses:
``6 * N + 12 * L * H * d_head * T`` for forward plus backward, with N the parameters doing
matmuls (input embedding tables excluded, a tied output head included), L blocks, H * d_head the
attention width and T the sequence length. Hardware FLOPs add what activation checkpointing
recomputes. :func:`counted_flops_per_token` cross-checks the formula with torch's FLOP counter on a
fake-tensor forward (nothing allocated).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_llm.parallel.blocks import find_blocks

# Dense (no sparsity) peak FLOP/s per device, from the vendors' datasheets: NVIDIA A100 (2020), H100
# SXM/PCIe/NVL (2023), H200 (2024), B200/GB200 (HGX/NVL72 per-GPU figures, 2025), L40S, L4; AMD MI300X,
# MI325X. A10G (AWS) has no NVIDIA datasheet: AWS's published g5 figures. "tf32" also stands for fp32
# matmuls on NVIDIA tensor cores. This table comes before Lightning's get_available_flops because
# Lightning lists some cards (H100 NVL, H200) at their 2:4-sparsity figures, twice the dense peak.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.9e12, "tf32": 417.8e12, "fp32": 60.0e12},
    "H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "fp8": 1513.0e12, "tf32": 378.0e12, "fp32": 51.2e12},
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H200 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "fp8": 1670.9e12, "tf32": 417.8e12, "fp32": 60.0e12},
    "GB200": {"bf16": 2.5e15, "fp16": 2.5e15, "fp8": 5.0e15, "tf32": 1.25e15, "fp32": 80e12},
    "B200": {"bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15, "tf32": 1.1e15, "fp32": 75e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "fp8": 733e12, "tf32": 183e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp8": 242.5e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "MI325X": {"bf16": 1307.4e12, "fp16": 1307.4e12, "fp8": 2614.9e12, "tf32": 653.7e12, "fp32": 163.4e12},
    "MI300X": {"bf16": 1307.4e12, "fp16": 1307.4e12, "fp8": 2614.9e12, "tf32": 653.7e12, "fp32": 163.4e12},
}
# Device-name patterns (as torch.cuda.get_device_name reports them), most specific first.
_NAME_PATTERNS = [
    (r"H100.*NVL", "H100 NVL"), (r"H100.*PCIe", "H100 PCIe"), (r"H100", "H100 SXM"), (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200"), (r"GB200", "GB200"), (r"B200", "B200"), (r"A100", "A100"), (r"L40S", "L40S"), (r"\bL4\b", "L4"),
    (r"A10G", "A10G"), (r"MI325", "MI325X"), (r"MI300X", "MI300X"),
]
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def precision_dtype(precision: str) -> str:
    """The compute dtype key of a Lightning precision string ("bf16-mixed" -> "bf16", "32-true" -> "fp32")."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if "transformer-engine" in precision or precision.startswith("fp8"):
        return "fp8"
    return "fp32"


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype`` ("bf16", "fp16", "fp8", "tf32", "fp32"), or None if unknown."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name):
            return PEAK_FLOPS[key].get(dtype)
    return None


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of ``device`` at the Trainer's precision; Lightning's table for cards ours lacks."""
    if device.type != "cuda":
        return None
    dtype = precision_dtype(precision)
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    found = peak_flops(torch.cuda.get_device_name(device), dtype)
    if found is None:
        from lightning.fabric.utilities.throughput import get_available_flops

        found = get_available_flops(device, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32))
    return found


def _tied_to_linear(module: nn.Module, embedding: nn.Embedding) -> bool:
    return any(isinstance(m, nn.Linear) and m.weight is embedding.weight for m in module.modules())


def matmul_parameters(module: nn.Module) -> int:
    """Parameters that take part in matmuls: all but input embedding tables (a tied output head counts)."""
    total = sum(p.numel() for p in module.parameters())
    for m in module.modules():
        if isinstance(m, nn.Embedding) and not _tied_to_linear(module, m):
            total -= m.weight.numel()
    return total


_QUERY = re.compile(r"(^|\.)(q|wq|q_proj|query|to_q)$")


def attention_width(module: nn.Module, blocks: nn.ModuleList) -> int:
    """H * d_head: the query projection's width, else the embedding width."""
    for name, m in blocks[0].named_modules():
        if isinstance(m, nn.Linear) and _QUERY.search(name):
            return m.out_features
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError("Cannot find the attention width: no query projection and no embedding; pass flops_per_token.")
    return embeddings[0].embedding_dim


@dataclass
class ModelShape:
    """What FLOP accounting needs to know of a model, taken once from the whole (unsharded) model."""

    matmul_parameters: int
    block_matmul_parameters: list[int]
    attention_width: int

    @classmethod
    def of(cls, module: nn.Module, blocks: str | None = None) -> ModelShape:
        """Read from ``module`` (parameters may be DTensors or on the meta device)."""
        _, block_list = find_blocks(module, blocks)
        return cls(
            matmul_parameters=matmul_parameters(module),
            block_matmul_parameters=[sum(p.numel() for p in b.parameters() if p.dim() >= 2) for b in block_list],
            attention_width=attention_width(module, block_list),
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs (forward + backward) per trained token: ``6 N + 12 L H d_head T``.

        Example::

            ModelShape.of(lightning_module).flops_per_token(seq_len=4096)
        """
        return 6 * self.matmul_parameters + 12 * len(self.block_matmul_parameters) * self.attention_width * seq_len

    def recompute_flops_per_token(self, seq_len: int, policies: list[str]) -> int:
        """FLOPs per token activation checkpointing adds: each fully checkpointed block's forward again.

        ``policies`` per block: "none", "full" or "op" (selective by operator keeps matmul outputs; the
        pointwise ops it recomputes are not counted in model FLOPs either).
        """
        forward = [2 * n + 4 * seq_len * self.attention_width for n in self.block_matmul_parameters]
        return sum(flops for flops, policy in zip(forward, policies) if policy == "full")


def counted_flops_per_token(module: nn.Module, step: Callable[[], torch.Tensor], tokens: int) -> float:
    """Forward FLOPs of ``step()`` counted by torch's FLOP counter on fake tensors, times 3 (backward = 2x), per token."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    from torch.nn.attention import SDPBackend, sdpa_kernel

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = {n: mode.from_tensor(p) for n, p in module.named_parameters(remove_duplicate=False)}
    # The math attention backend is plain matmuls the counter sees; fused CPU kernels count as zero.
    with _reparametrize_module(module, fake, tie_weights=True), mode, sdpa_kernel(SDPBackend.MATH), \
            FlopCounterMode(display=False) as counter:
        step()
    return 3 * counter.get_total_flops() / tokens
