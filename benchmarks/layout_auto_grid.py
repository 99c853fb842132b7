"""``layout="auto"``'s choice against the fastest measured layout of a 4-rank grid, on a dense and a MoE model (CPU).

Per model: every rank calibrates the rates over the 4 gloo ranks (:func:`~lightning_llm.strategies.layout_auto.
layout_rates` with ``"calibrate"``, as ``LLMParallelStrategy(layout="auto")`` does at setup), rank 0 ranks every
candidate for the global batch (:func:`~lightning_llm.strategies.layout_auto.rank_candidates`), and then the grid's
layouts and the chosen one train a few steps each under the standard ``Trainer``, alternated over rounds (each
round's step time the median of rank 0's steps after the first). Reported: each layout's measured median (min-max)
and predicted time, and the chosen layout's measured time over the fastest's.

    python benchmarks/layout_auto_grid.py [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import fields

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from lightning_llm.testing import run_distributed

WORLD, GLOBAL_BATCH, SEQ_LEN = 4, 8, 256
MODELS = {"dense": {}, "MoE": {"n_experts": 4, "top_k": 2}}
GRID = [  # (tp, sequence parallel, pp, cp, zero stage, checkpointing, micro-batches per step, ep)
    (1, False, 1, 1, 0, "none", 1, 1),
    (1, False, 1, 1, 2, "none", 1, 1),
    (1, False, 1, 1, 3, "none", 1, 1),
    (2, False, 1, 1, 0, "none", 1, 1),
    (1, False, 2, 1, 0, "none", 2, 1),
    (1, False, 1, 2, 3, "none", 1, 1),
    (1, False, 1, 1, 3, "full", 1, 1),
]
EXPERT_GRID = [(1, False, 1, 1, 0, "none", 1, 2), (1, False, 1, 1, 0, "none", 1, 4)]  # the MoE model's besides


def _model(name: str):
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    return CausalLM(LlamaConfig.from_name("small", max_seq_len=SEQ_LEN, **MODELS[name]))


def _key(layout) -> tuple:
    return (
        layout.tp,
        layout.sequence_parallel,
        layout.pp,
        layout.cp,
        layout.zero_stage,
        layout.activation_checkpointing,
        layout.micro_batches,
        layout.ep,
    )


def _measure(name: str, cell: tuple, steps: int) -> float:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_llm.strategies import LLMParallelStrategy
    from lightning_llm.testing.trainer import cpu_trainer

    tp, sp, pp, cp, zero, ac, micro_batches, ep = cell
    dp = WORLD // (tp * pp * cp)
    options = {"tensor_parallel_size": tp, "sequence_parallel": sp, "pipeline_parallel_size": pp}
    options["expert_parallel_size"] = ep
    options |= {"context_parallel_size": cp, "zero_stage": zero, "activation_checkpointing": ac}
    if pp > 1:
        options["num_microbatches"] = micro_batches
    accumulate = 1 if pp > 1 else micro_batches
    times: list[float] = []

    class StepTimes(L.Callback):
        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            if (trainer.fit_loop.batch_idx + 1) % accumulate == 0:
                times.append(time.perf_counter() - self.start)

    per_rank = GLOBAL_BATCH // dp // accumulate
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (GLOBAL_BATCH * steps, SEQ_LEN + 1), generator=generator)
    trainer = cpu_trainer(
        devices=WORLD,
        strategy=LLMParallelStrategy(**options),
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[StepTimes()],
    )
    trainer.fit(_model(name), DataLoader(data, batch_size=per_rank))
    return statistics.median(times[1:])


def _ranked(name: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_llm.strategies.layout_auto import rank_candidates
    from lightning_llm.strategies.layout_rates import block_unit, layout_rates

    cpu = torch.device("cpu")
    with torch.device("meta"):
        module = _model(name)
        module.configure_model()
    mesh = init_device_mesh("cpu", (WORLD,))
    rates = layout_rates("calibrate", precision="32-true", device=cpu, mesh=mesh, unit=block_unit(module))
    if dist.get_rank():
        return None
    module.log = lambda *args, **kwargs: None
    return rank_candidates(
        module, world_size=WORLD, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, device_memory=2**40, rates=rates
    )


def _grid(rounds: int, steps: int) -> dict | None:
    import torch.distributed as dist

    results = {}
    for name in MODELS:
        message = [_ranked(name)]
        dist.broadcast_object_list(message, src=0)
        ranked = message[0]
        chosen, predicted = _key(ranked[0].layout), {_key(c.layout): c.time for c in ranked}
        cells = list(dict.fromkeys([*GRID, *(EXPERT_GRID if MODELS[name] else []), chosen]))
        measured: dict = {cell: [] for cell in cells}
        for _ in range(rounds):
            for cell in cells:
                measured[cell].append(_measure(name, cell, steps))
        results[name] = (chosen, ranked[0].line(), {cell: (predicted.get(cell), measured[cell]) for cell in cells})
    return results if dist.get_rank() == 0 else None


def _label(cell: tuple) -> str:
    tp, sp, pp, cp, zero, ac, micro_batches, ep = cell
    dp = WORLD // (tp * pp * cp)
    parts = [f"tp{tp}" + (" SP" if sp else "")] if tp > 1 else []
    parts += [f"ep{ep}"] if ep > 1 else []
    parts += [f"pp{pp} x {micro_batches} micro-batches"] if pp > 1 else []
    parts += [f"cp{cp}"] if cp > 1 else []
    parts += [f"dp{dp} ZeRO {zero}"] if dp > 1 else [f"ZeRO {zero}"]
    parts += [f"AC {ac}"] if ac != "none" else []
    parts += [f"{micro_batches} micro-batches"] if pp == 1 and micro_batches > 1 else []
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = run_distributed(_grid, WORLD, args.rounds, args.steps, timeout=5400)[0]
    for name, (chosen, line, cells) in results.items():
        print(f"\n{name}: Chosen: {line}")
        print("| layout | predicted ms | measured ms (median, min-max) |")
        print("|---|---|---|")
        medians = {cell: statistics.median(times) for cell, (_, times) in cells.items()}
        for cell, (predicted, times) in cells.items():
            mark = " (chosen)" if cell == chosen else ""
            shown = f"{predicted.total * 1e3:.0f}" if predicted is not None else "-"
            print(
                f"| {_label(cell)}{mark} | {shown} | {medians[cell] * 1e3:.0f} "
                f"({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}) |"
            )
        for cell, (predicted, _) in cells.items():
            if predicted is not None:
                parts = ", ".join(f"{f.name} {getattr(predicted, f.name) * 1e3:.0f}" for f in fields(predicted))
                print(f"  {_label(cell)}: {parts}")
        fastest = min(medians, key=medians.get)
        print(f"chosen / fastest measured ({_label(fastest)}): {medians[chosen] / medians[fastest]:.2f}")


if __name__ == "__main__":
    main()
