"""``lightning-llm plan --layout auto``: every layout of the machine ranked by predicted step time; one ``Chosen:`` line.

The global batch is the config's (its micro-batch x data-parallel size x ``accumulate_grad_batches``), kept by every
candidate; the rates are a known device's (``--rates H100``) or measured on this machine (``--rates calibrate``:
matmul, memory and per-op costs; without a process group, links are taken as free).
"""

from __future__ import annotations

from typing import Any

SHOWN = 10


def layout_report(module, settings: dict[str, Any], *, rates_name: str, accumulate: int, devices_per_node: int) -> str:
    """The ranked candidates (the fastest ``SHOWN``), the chosen one and why the runner-up lost."""
    import torch

    from lightning_llm.strategies.layout_auto import rank_candidates, report_lines
    from lightning_llm.strategies.layout_rates import layout_rates

    world = settings["world_size"]
    dp = world // (settings["tp"] * settings["pp"] * settings["cp"])
    global_batch = settings["micro_batch_size"] * dp * accumulate
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rates = layout_rates(rates_name, precision=settings["precision"], device=device, node_size=devices_per_node)
    ranked = rank_candidates(
        module,
        world_size=world,
        seq_len=settings["seq_len"],
        global_batch=global_batch,
        device_memory=settings["device_memory"],
        rates=rates,
        precision=settings["precision"],
        margin=settings["margin"],
        context_parallel_method=settings["context_parallel_method"],
        documents=settings["documents"],
    )
    fitting = sum(c.fits for c in ranked)
    head = (f"layout='auto': {len(ranked)} layouts of {world} devices for {global_batch} sequences per step, "
            f"{fitting} fit; fastest first:")  # fmt: skip
    return "\n".join([head, *report_lines(ranked, SHOWN)])
