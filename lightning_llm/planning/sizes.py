"""Byte sizes as users write them (``"80GB"``, ``"24GiB"``) and as the planner prints them."""

from __future__ import annotations

GiB = 2**30


def parse_size(text: str | int | float) -> int:
    """Bytes from "80GB", "80GiB", "24G", "512MB" or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {
        "": 1,
        "B": 1,
        "K": 2**10,
        "KB": 10**3,
        "KIB": 2**10,
        "M": 2**20,
        "MB": 10**6,
        "MIB": 2**20,
        "G": 2**30,
        "GB": 10**9,
        "GIB": 2**30,
        "T": 2**40,
        "TB": 10**12,
        "TIB": 2**40,
    }
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGTIB")
    unit = stripped[len(number) :]
    try:
        return int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise ValueError(f"Cannot read the size {text!r}; write it like '80GB', '80GiB' or '24G'.") from None


def format_size(num_bytes: float) -> str:
    """``num_bytes`` in GiB, or in MiB below one GiB, with one decimal (``"79.6 GiB"``)."""
    return f"{num_bytes / GiB:.1f} GiB" if num_bytes >= GiB else f"{num_bytes / 2**20:.1f} MiB"
