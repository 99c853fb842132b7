"""The MFU benchmark runs on CPU at tiny size through the same code path it uses on GPUs."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Set in this process by any earlier in-process run that joined a process group (Lightning writes MASTER_PORT into
# os.environ): a child inheriting it would try to listen on a port this process's store still holds (EADDRINUSE).
_DISTRIBUTED_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)


def _fresh_env() -> dict[str, str]:
    """This process's environment without the torch.distributed variables: each benchmark starts its own group."""
    return {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARIABLES}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS...`` from the repository root in a clean environment; fails on a non-zero exit."""
    result = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=_fresh_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _run_quick(script: str) -> subprocess.CompletedProcess:
    """``python SCRIPT --quick``: a benchmark's smoke run."""
    return _run(script, "--quick")


def test_mfu_benchmark_cpu_smoke():
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/mfu.py",
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--precision",
            "32-true",
            "--seq-len",
            "64",
            "--batch",
            "4",
            "--steps",
            "6",
            "--warmup",
            "2",
            "--rounds",
            "1",
            "--peak-flops",
            "1e12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=_fresh_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for name in ("lightning", "raw"):
        match = re.search(rf"{name}:\s+([\d.]+) ms/step\s+(\d+) tokens/s\s+MFU ([\d.e-]+)", out)
        assert match, out
        step_ms, tokens_per_s, mfu = map(float, match.groups())
        assert step_ms > 0 and tokens_per_s > 0
        assert 0 < mfu < 1
    assert re.search(r"ratio \(Lightning step time / raw step time\): [\d.]+", out)


def test_alternate_runs_every_side_once_per_round_in_shuffled_orders():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _timing import alternate, ratios, spread

    calls: list[str] = []
    values = alternate(["a", "b", "c"], lambda side: calls.append(side) or float(len(calls)), rounds=6, seed=1)
    rounds = [calls[i : i + 3] for i in range(0, 18, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # the order changes between rounds
    for side in "abc":  # each side's values are its calls' positions, in round order
        assert values[side] == [float(3 * i + r.index(side) + 1) for i, r in enumerate(rounds)]
    assert ratios([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
    assert spread([3.0, 1.0, 2.0]) == "median 2.000 (min 1.000, max 3.000, 3 rounds)"


def test_checkpoint_stall_quick_reports_the_spread_of_per_round_ratios():
    result = _run_quick("benchmarks/checkpoint_stall.py")
    match = re.search(r"async/sync median ([\d.]+) \(min ([\d.]+), max ([\d.]+), 2 rounds\)", result.stdout)
    assert match, result.stdout
    median, low, high = map(float, match.groups())
    assert 0 < low <= median <= high


def test_strategy_overhead_quick_alternates_both_strategies():
    result = _run_quick("benchmarks/strategy_overhead.py")
    assert re.search(
        r"ratio LLMParallelStrategy / hand-written: median [\d.]+ \(min [\d.]+, max [\d.]+, 2 rounds\)", result.stdout
    ), result.stdout


def test_activation_checkpointing_quick_reports_every_mode_against_none():
    result = _run_quick("benchmarks/activation_checkpointing.py")
    rows = re.findall(
        r"^(\S+)\s+([\d.]+) MiB\s+([\d.]+)\s+[\d.]+ ms\s+median ([\d.]+) \(min ([\d.]+), max ([\d.]+), 2 rounds\)",
        result.stdout,
        re.MULTILINE,
    )
    modes = {row[0]: row for row in rows}
    assert "none" in modes and "full" in modes, result.stdout
    assert float(modes["none"][2]) == 1.0 and float(modes["none"][3]) == 1.0  # none against itself
    assert float(modes["full"][1]) < float(modes["none"][1])  # full checkpointing keeps fewer activations


def test_expert_parallel_quick_compares_layouts_on_time_and_held_bytes():
    from lightning_llm.models import Llama, LlamaConfig

    result = _run_quick("benchmarks/expert_parallel.py")
    for layout in ("tp2", "zero3"):
        assert re.search(
            rf"step time {layout} / ep2: median [\d.]+ \(min [\d.]+, max [\d.]+, 2 rounds\)", result.stdout
        )
    held = {k: float(v) for k, v in re.findall(r"^(\w+): .*held per rank ([\d.]+) MiB", result.stdout, re.MULTILINE)}
    # Oracle: fp32 parameters, gradients and AdamW's two moments, split evenly over the 2 ranks (ep2 and ZeRO 3 shard
    # or split everything; tp2 splits all but the norms and routers, a few percent of tiny-moe).
    states = 4 * 4 * sum(p.numel() for p in Llama(LlamaConfig.from_name("tiny-moe")).parameters()) / 2**20
    assert held["ep2"] == pytest.approx(states / 2, rel=0.02), held
    assert held["zero3"] == pytest.approx(states / 2, rel=0.02), held
    assert states / 2 <= held["tp2"] <= 0.6 * states, held


def test_sharded_muon_quick_times_both_optimizers_per_layout():
    result = _run_quick("benchmarks/sharded_muon.py")
    for layout in ("zero3", "tp2"):
        found = re.search(
            rf"{layout} optimizer step sharded / torch: median ([\d.]+) \(min [\d.]+, max [\d.]+, 2 rounds\)",
            result.stdout,
        )
        assert found, result.stdout
        # torch's Muon runs every iteration on DTensors across both ranks: about 4x slower at this size.
        assert float(found.group(1)) < 1.0, result.stdout


def test_gpu_suite_writes_its_report_when_stopped_mid_step(tmp_path):
    """A lent GPU's time runs out mid-step: the suite's TERM trap stops the step and reports what was measured."""
    report = tmp_path / "report.md"
    env = {**_fresh_env(), "PYTHON": sys.executable, "WHEELS": str(tmp_path / "none"), "SUITE_LOGS": str(tmp_path)}
    # The TERM comes while the second step runs, as a lent machine's `timeout` sends it: once the first step (a tiny
    # MFU run, 6-20 s on a 2-core machine under load) is in the steps table.
    command = ["timeout", "-k", "5", "600", "bash", "benchmarks/gpu_suite.sh", "--quick", str(report)]
    suite = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    steps, deadline = tmp_path / "steps.md", time.monotonic() + 180
    while "| mfu-tiny-ac_none |" not in (steps.read_text() if steps.exists() else ""):
        assert suite.poll() is None and time.monotonic() < deadline, "the suite's first step did not finish"
        time.sleep(0.5)
    time.sleep(2)
    suite.send_signal(signal.SIGTERM)  # timeout passes it on to the suite, as when its own limit runs out
    output, _ = suite.communicate(timeout=60)
    assert suite.returncode == 124, output[-4000:]
    text = report.read_text()
    assert "Failed steps: interrupted." in text and "| mfu-tiny-ac_none | ok |" in text, text
    # The step gets the TERM; one that handles it (Lightning does) is killed 10 s later.
    deadline = time.monotonic() + 15
    while subprocess.run(["pgrep", "-f", str(tmp_path / "mfu.md")], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the step that was running must be stopped with the suite"
        time.sleep(0.5)


def test_architecture_sweep_trains_a_named_architecture_against_one_process():
    result = _run("benchmarks/architecture_sweep.py", "--models", "Olmo3", "--layouts", "tp2")
    row = re.search(r"\| Olmo3 \| tp2 \| loss (\S+), params (\S+), held (\{.*?\}), differing (\d+) \|", result.stdout)
    assert row, result.stdout[-2000:]
    assert float(row[1]) <= 1e-5 and float(row[2]) <= 1e-5 and row[4] == "0", row[0]
    assert json.loads(row[3])["attention"] <= 0.55, row[0]  # each rank holds about half the attention parameters
