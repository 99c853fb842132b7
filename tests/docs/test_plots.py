"""The performance page's plots show the numbers its tables hold now (benchmarks/plot_results.py).

Each SVG carries the data it plots as JSON in its description; the oracle is the table in the page, parsed again.
A plot left stale after a table changed fails here with the command that redraws it.
"""

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plot_results  # noqa: E402

PLOTS = [
    ("gpu", "docs/gpu_results.md", "docs/_static/gpu_throughput.svg"),
    ("ac", "docs/performance.md", "docs/_static/activation_checkpointing.svg"),
]


def _plotted(svg: Path) -> dict:
    ns = {"dc": "http://purl.org/dc/elements/1.1/"}
    return json.loads(ET.parse(svg).getroot().find(".//dc:description", ns).text)


def _tabled(kind: str, source: str) -> list[dict]:
    text = (ROOT / source).read_text()
    return plot_results.gpu_data(text) if kind == "gpu" else plot_results.ac_data(text)


@pytest.mark.parametrize("kind, source, svg", PLOTS, ids=[p[0] for p in PLOTS])
def test_each_plot_shows_the_table_it_was_drawn_from(kind, source, svg):
    plotted = _plotted(ROOT / svg)
    assert plotted["source"] == source
    assert plotted["data"] == _tabled(kind, source), (
        f"{svg} is stale: redraw it with `python benchmarks/plot_results.py {kind} {source} {svg}`"
    )
    assert svg.split("/", 1)[1] in (ROOT / "docs" / "performance.md").read_text(), f"{svg} is not on the page"


def test_the_tables_are_read_by_hand_counted_rows():
    gpu = _tabled("gpu", "docs/gpu_results.md")
    # Three runs of four rows each: H200 2026-11-28 (commit ce3c8d3), H200 2026-11-27, H100 2026-11-26.
    assert len(gpu) == 12 and {d["device"] for d in gpu} == {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    assert {"device": "NVIDIA H200", "configuration": "fp8 + compiled", "tokens_per_s": 64220,
            "mfu_percent": 53.4} in gpu  # fmt: skip
    assert {"device": "NVIDIA H200", "configuration": "fp8 + compiled", "tokens_per_s": 63271,
            "mfu_percent": 52.6} in gpu  # fmt: skip
    ac = {d["mode"]: d for d in _tabled("ac", "docs/performance.md")}
    assert ac["none"]["ratio"] == ac["none"]["ratio_min"] == 1.0
    assert (ac["full"]["ratio_min"], ac["full"]["ratio"], ac["full"]["ratio_max"]) == (1.14, 1.26, 1.40)


def test_the_script_draws_what_it_read(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the plots (dev extra)")
    import matplotlib

    matplotlib.use("Agg")
    for kind, source, _ in PLOTS:
        out = tmp_path / f"{kind}.svg"
        data = _tabled(kind, source)
        (plot_results.plot_gpu if kind == "gpu" else plot_results.plot_ac)(data, out, source)
        assert _plotted(out) == {"source": source, "data": data}
        assert out.read_text().count("<path") > len(data)  # bars / markers were drawn
