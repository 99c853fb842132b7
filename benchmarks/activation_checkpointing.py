"""Peak activation memory and step time of each activation-checkpointing mode: one model, one batch, one run.

Peak activations: on CPU, torch's MemTracker (tensors autograd keeps and backward temporaries, at the
peak of all tracked memory; gradients are allocated beforehand so they do not move the peak); on
CUDA, the allocator's peak above parameters and gradients. "auto" gets a budget halfway between
full checkpointing and none (``--budget-fraction``) and reports its plan. Step times (forward +
backward): rounds run every mode once in a shuffled order; the per-round ratio to "none" is quoted as
median (min, max).

    python benchmarks/activation_checkpointing.py --preset small --batch 8 --seq-len 256 --rounds 7
    python benchmarks/activation_checkpointing.py --preset 125M --batch 8 --seq-len 1024 --device cuda
    python benchmarks/activation_checkpointing.py --quick     # CI smoke: tiny preset, 2 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _timing import alternate, ratios, spread
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_llm.modeling.activations import measure_blocks
from lightning_llm.models import CausalLM
from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_llm.planning.activation_budget import predicted_peak

MODES = {
    "none": dict(mode="none"),
    "full": dict(mode="full"),
    "selective op": dict(mode="selective", selective="op"),
    "selective op, every other mm": dict(mode="selective", selective="op", recompute_every_other_matmul=True),
    "selective layer (every 2nd)": dict(mode="selective", selective="layer", every_n_layers=2),
    "auto": dict(mode="auto"),
}


def build(preset: str, device: torch.device) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(preset)
    with device:
        module.configure_model()
    module.log = lambda *args, **kwargs: None
    for p in module.parameters():  # allocated now: the peaks below are activations and temporaries only
        p.grad = torch.zeros_like(p)
    return module


def step(module: CausalLM, batch: torch.Tensor) -> None:
    module.training_step(batch, 0).backward()


def peak_activations(module: CausalLM, batch: torch.Tensor) -> int:
    if batch.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(module, batch)
        return torch.cuda.max_memory_allocated() - base
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        step(module, batch)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return sum(v for k, v in peak.items() if "ACT" in str(k) or "TEMP" in str(k))


def step_time(module: CausalLM, batch: torch.Tensor) -> float:
    if batch.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(module, batch)
    if batch.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def auto_options(preset: str, batch: torch.Tensor, fraction: float) -> dict:
    probe = build(preset, batch.device)
    sizes = measure_blocks(probe.model.layers, lambda: probe.training_step(batch, 0))
    saved, inputs = [s.saved for s in sizes], [s.input for s in sizes]
    low, high = predicted_peak(saved, inputs), predicted_peak(saved, saved)
    return dict(mode="auto", budget=int(low + fraction * (high - low)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget-fraction", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads; 1 keeps ratios stable on a shared host")
    parser.add_argument("--quick", action="store_true", help="CI smoke: tiny preset, batch 2 x 32, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.batch, args.seq_len, args.rounds = "tiny", 2, 32, 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batch = torch.randint(0, 256, (args.batch, args.seq_len + 1), device=device)
    modules, reports = {}, {}
    for name, options in MODES.items():
        if name == "auto":
            options = auto_options(args.preset, batch, args.budget_fraction)
        module = modules[name] = build(args.preset, device)
        if name == "auto":
            options["measure_fn"] = lambda m=module: m.training_step(batch, 0)
        reports[name] = apply_activation_checkpointing(module.model.layers, **options)
    peaks = {name: peak_activations(module, batch) for name, module in modules.items()}
    for module in modules.values():
        step_time(module, batch)  # warm-up
    times = alternate(list(modules), lambda name: step_time(modules[name], batch), args.rounds)
    base_peak = peaks["none"]
    print(
        f"preset={args.preset}, batch {args.batch} x {args.seq_len}, {args.device} ({args.threads} CPU threads), "
        f"{args.rounds} alternating rounds"
    )
    print(f"{'mode':<30} {'peak activations':>17} {'vs none':>8} {'step time':>10}  step-time ratio to none")
    for name in modules:
        median = statistics.median(times[name])
        print(
            f"{name:<30} {peaks[name] / 2**20:13.1f} MiB {peaks[name] / base_peak:8.2f} "
            f"{median * 1e3:7.1f} ms  {spread(ratios(times[name], times['none']), 2)}"
        )
    auto = reports["auto"]
    print(f"auto: {auto.summary()}; policies {auto.policies}")


if __name__ == "__main__":
    main()
