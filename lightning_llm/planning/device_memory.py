"""Device memory as users write it: a GPU's name (``"H100"``), its marketed size (``"80GB"``) or exact bytes.

Vendors print a GPU's memory in binary units with a decimal name: an "80GB" H100 carries 80 GiB of HBM, of which
the driver shows 81,559 MiB (79.6 GiB) to programs; 80 x 10^9 bytes (74.5 GiB) would plan 5 GiB short of the card.
So a device memory in ``GB`` that is a known device's marketed size reads as that device's capacity (the smallest,
where several devices share a size), any other ``GB`` size as GiB, and ``GiB``/``MiB`` sizes exactly.
Capacities are ``nvidia-smi --query-gpu=memory.total`` of each device; CUDA gives one process a few hundred MiB less,
which the planner's margin (10% by default) covers.
"""

from __future__ import annotations

from lightning_llm.planning.sizes import parse_size

MiB = 2**20

# name: (marketed size in GB, memory.total in MiB as nvidia-smi reports it)
DEVICES: dict[str, tuple[int, int]] = {
    "H100": (80, 81_559),  # H100 80GB HBM3 (SXM5) and H100 PCIe
    "H200": (141, 143_771),  # seen on this project's lent H200 (/work/.library/device/KINDS.md)
    "A100": (80, 81_920),  # A100-SXM4-80GB
    "A100-80GB": (80, 81_920),
    "A100-40GB": (40, 40_960),
    "L40S": (48, 46_068),
    "L4": (24, 23_034),
    "A10G": (24, 23_028),
    "RTX4090": (24, 24_564),
}


def device_memory_bytes(text: str | int | float) -> int:
    """Bytes of one device's memory from a device name, a marketed size or an exact size.

    Example::

        device_memory_bytes("H100") == device_memory_bytes("80GB") == 81_559 * 2**20
        device_memory_bytes("80GiB") == 80 * 2**30
    """
    if isinstance(text, (int, float)):
        return int(text)
    key = text.strip().upper().replace(" ", "").replace("_", "-")
    named = {name.upper(): mib for name, (_, mib) in DEVICES.items()}
    if key in named:
        return named[key] * MiB
    if key.endswith("GB") and not key.endswith("GIB"):
        number = key[:-2]
        try:
            size = float(number)
        except ValueError:
            raise _unreadable(text) from None
        marketed = [mib for gb, mib in DEVICES.values() if gb == size]
        return min(marketed) * MiB if marketed else int(size * 2**30)
    try:
        return parse_size(text)
    except ValueError:
        raise _unreadable(text) from None


def _unreadable(text: object) -> ValueError:
    return ValueError(
        f"Cannot read the device memory {text!r}; write a device name ({', '.join(DEVICES)}), its size as sold "
        "('80GB'), an exact size ('79.6GiB', '81559MiB') or a number of bytes."
    )
