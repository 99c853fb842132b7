"""Peak activation memory and step time of each activation-checkpointing mode, one model, one batch, one run.

Peak activation bytes come from torch's MemTracker (tensors autograd keeps, tracked on CPU);
step times are medians over alternating rounds, reported as ratios to "none".

    python benchmarks/activation_checkpointing.py --preset small --batch 8 --seq-len 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_llm.models import CausalLM
from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing, plan_for_budget
from lightning_llm.parallel.activation_memory import measure_block_activations, silenced_logging

MODES = {
    "none": dict(mode="none"),
    "full": dict(mode="full"),
    "selective op": dict(mode="selective", selective="op"),
    "selective op, every other mm": dict(mode="selective", selective="op", recompute_every_other_matmul=True),
    "selective layer (every 2nd)": dict(mode="selective", selective="layer", every_n_layers=2),
}


def build(preset: str, options: dict) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(preset)
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    apply_activation_checkpointing(list(module.model.layers), **options)
    return module


def peak_activations(module: CausalLM, batch: torch.Tensor) -> int:
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        module.training_step(batch, 0).backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return next(v for k, v in peak.items() if "ACT" in str(k))


def step_time(module: CausalLM, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    module.training_step(batch, 0).backward()
    module.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    batch = torch.randint(0, 256, (args.batch, args.seq_len + 1))
    probe = build(args.preset, MODES["none"])
    with silenced_logging(probe):
        sizes = measure_block_activations(probe, list(probe.model.layers), lambda: probe.training_step(batch, 0))
    saved, inputs = [s.saved for s in sizes], [s.input for s in sizes]
    budget = sum(inputs) + (sum(saved) - sum(inputs)) // 2
    policies, _ = plan_for_budget(saved, inputs, budget)
    modes = {**MODES, f"auto (budget {budget / 2**20:.1f} MiB)": dict(mode="auto", auto_policies=policies)}
    modules = {name: build(args.preset, options) for name, options in modes.items()}
    times = {name: [] for name in modules}
    for name, module in modules.items():
        step_time(module, batch)  # warm-up
    for _ in range(args.rounds):
        for name, module in modules.items():
            times[name].append(step_time(module, batch))
    base_time = statistics.median(times["none"])
    base_peak = peak_activations(modules["none"], batch)
    print(f"preset={args.preset}, batch {args.batch} x {args.seq_len}, CPU, {args.rounds} alternating rounds")
    print(f"{'mode':<34} {'peak activations':>17} {'vs none':>8} {'step time':>10}")
    for name, module in modules.items():
        peak = peak_activations(module, batch)
        ratio = statistics.median(times[name]) / base_time
        print(f"{name:<34} {peak / 2**20:13.1f} MiB {peak / base_peak:8.2f} {ratio:9.2f}x")


if __name__ == "__main__":
    main()
