"""The performance page's plots, drawn from the Markdown tables the benchmarks wrote (the figures stay the tables').

    python benchmarks/plot_results.py gpu docs/gpu_results.md docs/_static/gpu_throughput.svg
    python benchmarks/plot_results.py ac docs/performance.md docs/_static/activation_checkpointing.svg

``gpu``: tokens/s and MFU of every MFU table in a GPU-suite report (one bar group per configuration, one bar per
device). ``ac``: peak activations against the step-time ratio (median with min/max) of the activation-checkpointing
benchmark's table. Each SVG carries the numbers it plots as JSON in its description (``<dc:description>``), which
``tests/docs/test_plots.py`` compares with the tables, so a plot never shows figures the page no longer has.
Needs matplotlib (in the ``dev`` extra); writes deterministic SVG (no date, fixed hash salt).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

GPU_COLUMNS = ("device", "fp8", "AC", "compile", "tokens/s", "MFU")
AC_COLUMNS = ("mode", "peak activations", "step-time ratio to none")
SEPARATOR = re.compile(r"^\|\s*:?-{3,}")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str, columns: tuple[str, ...]) -> list[list[dict[str, str]]]:
    """Every Markdown table in ``text`` whose header holds ``columns``, as rows of ``{column: cell}``."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and SEPARATOR.match(lines[i + 1]) and set(columns) <= set(_cells(line))):
            continue
        rows = []
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            rows.append(dict(zip(_cells(line), _cells(row))))
        found.append(rows)
    return found


def gpu_data(report: str) -> list[dict]:
    """(device, configuration, tokens/s, MFU %) of every row of every MFU table in a GPU-suite report."""
    data = []
    for rows in tables(report, GPU_COLUMNS):
        for row in rows:
            config = ("fp8 + " if row["fp8"] == "True" else "") + ("compiled" if row["compile"] == "True" else "eager")
            config += ", AC selective" if row["AC"] == "selective" else ""
            data.append({"device": row["device"], "configuration": config, "tokens_per_s": int(row["tokens/s"]),
                         "mfu_percent": float(row["MFU"].rstrip("%"))})  # fmt: skip
    return data


def ac_data(page: str) -> list[dict]:
    """(mode, peak activations MiB, step-time ratio median/min/max) of the activation-checkpointing table."""
    (rows,) = tables(page, AC_COLUMNS)
    data = []
    for row in rows:
        numbers = [float(x) for x in re.findall(r"[0-9.]+", row["step-time ratio to none"])]
        median, low, high = (numbers * 3)[:3] if len(numbers) == 1 else numbers
        data.append({"mode": row["mode"], "peak_mib": float(row["peak activations"].split()[0]),
                     "ratio": median, "ratio_min": low, "ratio_max": high})  # fmt: skip
    return data


def _save(fig, out: Path, data: list[dict], source: str) -> None:
    import matplotlib

    matplotlib.rcParams["svg.hashsalt"] = "lightning_llm"
    description = json.dumps({"source": source, "data": data}, sort_keys=True)
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None, "Description": description})


def plot_gpu(data: list[dict], out: Path, source: str) -> None:
    import matplotlib.pyplot as plt

    devices = list(dict.fromkeys(d["device"] for d in data))
    configs = list(dict.fromkeys(d["configuration"] for d in data))
    width = 0.8 / len(devices)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, device in enumerate(devices):
        for j, config in enumerate(configs):
            row = next((d for d in data if d["device"] == device and d["configuration"] == config), None)
            if row is None:
                continue
            x = j + (i - (len(devices) - 1) / 2) * width
            ax.bar(x, row["tokens_per_s"], width, color=f"C{i}", label=device if j == 0 else None)
            ax.text(x, row["tokens_per_s"], f"{row['mfu_percent']:.1f}%", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.25 * max(d["tokens_per_s"] for d in data))  # room for the legend above the bars
    ax.set_xticks(range(len(configs)), configs, fontsize=8)
    ax.set_ylabel("tokens/s (label: MFU)")
    ax.set_title("1B preset, bf16-mixed, batch 4 x 2048, one GPU (gpu_suite.sh --short)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncol=len(devices))
    _save(fig, out, data, source)


def plot_ac(data: list[dict], out: Path, source: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, row in enumerate(data):
        err = [[row["ratio"] - row["ratio_min"]], [row["ratio_max"] - row["ratio"]]]
        ax.errorbar(row["peak_mib"], row["ratio"], yerr=err, fmt="o", color=f"C{i}", capsize=3, label=row["mode"])
    ax.set_xlabel("peak activations (MiB, torch's MemTracker)")
    ax.set_ylabel("step time / no checkpointing")
    ax.set_title("Activation checkpointing on CPU: median (min, max) over 7 rounds", fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, out, data, source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("gpu", "ac"))
    parser.add_argument("source", type=Path, help="the Markdown file holding the benchmark's table(s)")
    parser.add_argument("out", type=Path, help="the SVG to write")
    args = parser.parse_args()
    text = args.source.read_text()
    data = gpu_data(text) if args.kind == "gpu" else ac_data(text)
    (plot_gpu if args.kind == "gpu" else plot_ac)(data, args.out, str(args.source))
    print(f"{args.out}: {len(data)} points from {args.source}")


if __name__ == "__main__":
    main()
