"""``lightning-llm plan --layout auto``: every layout of the machine ranked by predicted step time; one ``Chosen:`` line.

The global batch is the config's (its micro-batch x data-parallel size x ``accumulate_grad_batches``), kept by every
candidate; the rates are a known device's (``--rates H100``) or measured on this machine (``--rates calibrate``:
matmul, memory and per-op costs; without a process group, links are taken as free).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

SHOWN = 10


def _rates(name: str, precision: str, devices_per_node: int):
    import torch

    from lightning_llm.planning.calibration import calibrate
    from lightning_llm.planning.device_rates import device_rates
    from lightning_llm.planning.flops import precision_dtype

    if name != "calibrate":
        return device_rates(name, dtype=precision_dtype(precision), node_size=devices_per_node)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if precision.startswith("bf16") and device.type == "cuda" else torch.float32
    return calibrate(tokens=4096, hidden=1024, width=1024, dtype=dtype, device=device)


def _why(runner_up, chosen) -> str:
    """How much slower ``runner_up`` is predicted, and the part of the step time that differs most."""
    parts = {f.name: getattr(runner_up.time, f.name) - getattr(chosen.time, f.name) for f in fields(chosen.time)}
    name = max(parts, key=lambda k: abs(parts[k]))
    more = "more" if parts[name] > 0 else "less"
    slower = runner_up.time.total / chosen.time.total - 1
    return f"{slower:+.1%} predicted: {abs(parts[name]) * 1e3:.1f} ms {more} {name.replace('_', ' ')}"


def layout_report(module, settings: dict[str, Any], *, rates_name: str, accumulate: int, devices_per_node: int) -> str:
    """The ranked candidates (the fastest ``SHOWN``), the chosen one and why the runner-up lost."""
    from lightning_llm.strategies.layout_auto import rank_candidates

    world = settings["world_size"]
    dp = world // (settings["tp"] * settings["pp"] * settings["cp"])
    global_batch = settings["micro_batch_size"] * dp * accumulate
    rates = _rates(rates_name, settings["precision"], devices_per_node)
    ranked = rank_candidates(
        module,
        world_size=world,
        seq_len=settings["seq_len"],
        global_batch=global_batch,
        device_memory=settings["device_memory"],
        rates=rates,
        precision=settings["precision"],
        margin=settings["margin"],
    )
    fitting = [c for c in ranked if c.fits]
    lines = [f"layout='auto': {len(ranked)} layouts of {world} devices for {global_batch} sequences per step, "
             f"{len(fitting)} fit; fastest first:"]  # fmt: skip
    lines += [f"  {c.line()}" for c in fitting[:SHOWN]]
    if not fitting:
        smallest = min(ranked, key=lambda c: c.memory)
        return "\n".join([*lines, f"Nothing fits; the smallest is {smallest.line()}"])
    chosen = fitting[0]
    lines.append(f"Chosen: {chosen.line()}")
    shape = lambda c: (c.layout.tp, c.layout.sequence_parallel, c.layout.pp, c.layout.cp)  # noqa: E731
    runner_up = next((c for c in fitting if shape(c) != shape(chosen)), None)  # the best other parallel layout
    if runner_up is not None:
        lines.append(f"Runner-up: {runner_up.line()}; {_why(runner_up, chosen)}")
    return "\n".join(lines)
