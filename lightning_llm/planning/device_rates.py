"""Rates of known devices and interconnects, for planning a machine one is not on (``lightning-llm plan --layout
auto --rates H100``). On the machine itself, :mod:`.calibration` measures them instead.

Matmuls are taken at 60% of the dense bf16 peak (:data:`~lightning_llm.planning.flops.PEAK_FLOPS`): an assumption,
between the whole-step MFU this project measured eager and compiled on a lent H100 and H200 (37-49%,
``docs/gpu_results.md``) and the isolated large GEMMs that reach more; memory at 80% of the datasheet bandwidth;
an op's launch and eager overhead at 10 microseconds. Links: NVLink as NVIDIA's datasheets give it per GPU and
direction (H100/H200 SXM: 900 GB/s both directions, A100 SXM: 600) at 80% for a ring, and between nodes one
400 Gb/s InfiniBand NDR adapter per GPU (DGX H100/H200) or 200 Gb/s HDR (DGX A100) at 90%, with a few
microseconds of latency per ring step.
"""

from __future__ import annotations

from lightning_llm.planning.flops import PEAK_FLOPS
from lightning_llm.planning.step_time import Link, Rates

_MEMORY_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s, SXM datasheets
_NVLINK = {"H100": 450e9, "H200": 450e9, "A100": 300e9}  # bytes/s per direction
_NETWORK = {"H100": 400e9 / 8, "H200": 400e9 / 8, "A100": 200e9 / 8}  # bytes/s per GPU
_PEAK_KEY = {"H100": "H100 SXM", "H200": "H200", "A100": "A100"}
KNOWN_DEVICES = tuple(_PEAK_KEY)  # the names device_rates() takes


def device_rates(name: str, *, dtype: str = "bf16", node_size: int = 8) -> Rates:
    """:class:`Rates` of device ``name`` ("H100", "H200", "A100") in ``dtype``: NVLink within a node of ``node_size``
    GPUs, InfiniBand between nodes. Example::

        device_rates("H100").network.bandwidth   # 45e9
    """
    key = name.upper().split("-")[0]
    if key not in _PEAK_KEY:
        raise ValueError(
            f"No rates for device {name!r}; known: {', '.join(_PEAK_KEY)}. Measure it on the device instead ('calibrate')."
        )
    return Rates(
        matmul_flops=0.6 * PEAK_FLOPS[_PEAK_KEY[key]][dtype],
        memory_bandwidth=0.8 * _MEMORY_BANDWIDTH[key],
        op_overhead=10e-6,
        link=Link(0.8 * _NVLINK[key], 5e-6),
        overlap=True,
        network=Link(0.9 * _NETWORK[key], 10e-6),
        node_size=node_size,
    )
