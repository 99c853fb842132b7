"""Peak FLOP/s of accelerators per compute dtype (model FLOPs per token: :mod:`lightning_llm.modeling.shape`)."""

from __future__ import annotations

import re

import torch

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
    (r"H100.*NVL", "H100 NVL"),
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100", "H100 SXM"),
    (r"H200.*NVL", "H200 NVL"),
    (r"H200", "H200"),
    (r"GB200", "GB200"),
    (r"B200", "B200"),
    (r"A100", "A100"),
    (r"L40S", "L40S"),
    (r"\bL4\b", "L4"),
    (r"A10G", "A10G"),
    (r"MI325", "MI325X"),
    (r"MI300X", "MI300X"),
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
