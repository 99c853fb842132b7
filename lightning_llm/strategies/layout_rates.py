"""The rates ``layout="auto"`` prices work at: a known device's table entry, or measured on the job's ranks with
stand-ins shaped like the model (:mod:`lightning_llm.planning.calibration`, :mod:`lightning_llm.planning.in_step`)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.planning.calibration import calibrate
from lightning_llm.planning.device_rates import KNOWN_DEVICES, device_rates
from lightning_llm.planning.flops import precision_dtype
from lightning_llm.planning.in_step import in_step_rates
from lightning_llm.planning.step_time import Rates


def rates_source(name: str, device: torch.device) -> str:
    """``name`` with ``"auto"`` resolved: the table's entry for this CUDA device where it has one, else
    ``"calibrate"``."""
    if name != "auto":
        return name
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((known for known in KNOWN_DEVICES if known in gpu), "calibrate")


def block_unit(module: nn.Module) -> tuple[int, int] | None:
    """(parameter tensors, parameters) of the model's first block: what one ZeRO unit holds (``None`` without
    blocks)."""
    blocks = list(find_blocks(module).blocks)
    params = list(blocks[0].parameters()) if blocks else []
    return (len(params), sum(p.numel() for p in params)) if params else None


def layout_rates(
    name: str,
    *,
    precision: str,
    device: torch.device,
    node_size: int = 8,
    mesh=None,
    unit: tuple[int, int] | None = None,
) -> Rates:
    """The rates step times are predicted from: a known device's (``"H100"``, ``"H200"``, ``"A100"``), measured here
    (``"calibrate"``: a matmul, memory, per-op costs and, given a 1-D ``mesh`` over the job's ranks, every rank
    calling, the collectives and the optimizer as a step meets them, :mod:`~lightning_llm.planning.in_step`), or
    ``"auto"``: the table's entry for this CUDA device where it has one, else measured. The stand-in shapes are
    small on a CPU (1,024 tokens, width 256 by 704), a layer's on a GPU (4,096 tokens, 1,024 by 4,096); ``unit`` (a
    block's tensors and parameters, :func:`block_unit`) shapes ZeRO's stand-in units like the model's."""
    name = rates_source(name, device)
    if name != "calibrate":
        return device_rates(name, dtype=precision_dtype(precision), node_size=node_size)
    dtype = torch.bfloat16 if precision.startswith("bf16") and device.type == "cuda" else torch.float32
    tokens, hidden, width = (4096, 1024, 4096) if device.type == "cuda" else (1024, 256, 704)
    rates = calibrate(tokens=tokens, hidden=hidden, width=width, dtype=dtype, device=device)
    if mesh is None or mesh.size() == 1:
        return rates
    return in_step_rates(rates, mesh, tokens=tokens, hidden=hidden, width=width, device=device, unit=unit)
