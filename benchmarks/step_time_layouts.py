"""Predicted against measured step time over a grid of layouts and sequence lengths, on 2 gloo ranks (CPU).

Each cell trains the ``small`` reference model (4 blocks, width 256) under ``LLMParallelStrategy`` with a standard
``Trainer`` for a few steps; a round's step time is the median of rank 0's optimizer steps after the first. The
prediction is :func:`~lightning_llm.planning.step_time.step_time` of the cell's layout, from the work of one
micro-batch recorded on fake tensors (:mod:`lightning_llm.modeling.op_work`), at the rates
:mod:`lightning_llm.planning.calibration` measures in the same process group at the start of each round (the shared
host's speed drifts over minutes). Rounds alternate the cells; each cell's ratio is the median over rounds.

    python benchmarks/step_time_layouts.py [--rounds 3] [--steps 3] [--layouts "dp2 ZeRO 3" ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from lightning_llm.testing import run_distributed

GLOBAL_BATCH = 4
LAYOUTS = {  # name: (strategy arguments, micro-batches per step)
    "dp2 ZeRO 0": ({"zero_stage": 0}, 1),
    "dp2 ZeRO 2": ({"zero_stage": 2}, 1),
    "dp2 ZeRO 3": ({"zero_stage": 3}, 1),
    "dp2 ZeRO 3, AC full": ({"zero_stage": 3, "activation_checkpointing": "full"}, 1),
    "dp2 ZeRO 3, AC selective": ({"zero_stage": 3, "activation_checkpointing": "selective"}, 1),
    "tp2": ({"tensor_parallel_size": 2, "zero_stage": 0}, 1),
    "tp2 SP": ({"tensor_parallel_size": 2, "sequence_parallel": True, "zero_stage": 0}, 1),
    "pp2, 2 micro-batches": ({"pipeline_parallel_size": 2, "num_microbatches": 2, "zero_stage": 0}, 2),
    "pp2, 4 micro-batches": ({"pipeline_parallel_size": 2, "num_microbatches": 4, "zero_stage": 0}, 4),
    "cp2 ZeRO 3": ({"context_parallel_size": 2, "zero_stage": 3}, 1),
    "MoE dp2 ZeRO 0": ({"zero_stage": 0}, 1),
    "MoE ep2 ZeRO 0": ({"zero_stage": 0, "expert_parallel_size": 2}, 1),
}
MOE = {"n_experts": 4, "top_k": 2}  # the MoE cells' model: every block's MLP 4 experts, each token to 2
SEQ_LENS = (128, 256)


def _model(seq_len: int, name: str = ""):
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    return CausalLM(LlamaConfig.from_name("small", max_seq_len=seq_len, **(MOE if name.startswith("MoE") else {})))


class _StepTimes:
    """Seconds of each optimizer step (batch start to batch end, the optimizer step included)."""

    def __init__(self) -> None:
        import lightning as L

        class Callback(L.Callback):
            def on_train_batch_start(inner, *args):
                self.start = time.perf_counter()

            def on_train_batch_end(inner, *args):
                self.times.append(time.perf_counter() - self.start)

        self.times: list[float] = []
        self.callback = Callback()


def _measure(name: str, seq_len: int, steps: int) -> float:
    from torch.utils.data import DataLoader

    from lightning_llm.strategies import LLMParallelStrategy
    from lightning_llm.testing.trainer import cpu_trainer

    kwargs, _ = LAYOUTS[name]
    dp = 2 // (kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1))
    dp //= kwargs.get("context_parallel_size", 1)
    data = torch.randint(0, 256, (GLOBAL_BATCH * steps, seq_len + 1), generator=torch.Generator().manual_seed(0))
    times = _StepTimes()
    trainer = cpu_trainer(
        devices=2, strategy=LLMParallelStrategy(**kwargs), max_steps=steps, callbacks=[times.callback]
    )
    trainer.fit(_model(seq_len, name), DataLoader(data, batch_size=GLOBAL_BATCH // dp))
    return statistics.median(times.times[1:])


def _work(name: str, seq_len: int) -> tuple:
    """(one micro-batch's recorded work on one rank, the layout, the rank's parameters, parameter tensors and, under
    expert parallelism, expert parameters) of a cell."""
    from lightning_llm.modeling.experts import expert_count
    from lightning_llm.modeling.op_work import forward_work
    from lightning_llm.parallel.tp.model_plan import planned_shares
    from lightning_llm.planning.step_time import StepLayout

    kwargs, micro_batches = LAYOUTS[name]
    tp, pp, cp = (kwargs.get(f"{k}_parallel_size", 1) for k in ("tensor", "pipeline", "context"))
    dp = 2 // (tp * pp * cp)
    with torch.device("meta"):
        module = _model(seq_len, name)
        module.configure_model()
    sp = kwargs.get("sequence_parallel", False)
    shares = planned_shares(module, tp=tp, sequence_parallel=sp) if tp > 1 else None
    batch = torch.zeros(GLOBAL_BATCH // dp // micro_batches, seq_len + 1, dtype=torch.long)
    work = forward_work(module, lambda: module.training_step(batch, 0), shares=shares, device=torch.device("cpu"))
    layout = StepLayout(
        world_size=2,
        tp=tp,
        pp=pp,
        cp=cp,
        zero_stage=kwargs.get("zero_stage", 3),
        activation_checkpointing=kwargs.get("activation_checkpointing", "none"),
        micro_batches=micro_batches,
        sequence_parallel=sp,
        ep=kwargs.get("expert_parallel_size", 1),
    )
    params = list(module.parameters())
    experts = sum(p.numel() for m in module.modules() if expert_count(m) for p in m.parameters())
    held = sum(p.numel() for p in params) - experts * (1 - 1 / layout.ep)
    rank_experts = experts / layout.ep / (tp * pp) if layout.ep > 1 else 0.0
    return work, layout, held / (tp * pp), len(params) / pp, rank_experts


def _fitted(rates):
    """``rates`` fitted to the model's own forward and backward at 2 x 128 and 2 x 256 tokens, timed on every rank at
    once (as the ranks compute in a run)."""
    from lightning_llm.modeling.op_work import forward_work
    from lightning_llm.planning.calibration import fitted_to_model, time_passes

    works, seconds = [], []
    for seq_len in (256, 128):
        module = _model(seq_len)
        module.configure_model()
        module.log = lambda *args, **kw: None
        batch = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
        works.append(forward_work(module, lambda: module.training_step(batch, 0)))
        seconds.append(time_passes(lambda: module.training_step(batch, 0).backward(), torch.device("cpu")))
    return fitted_to_model(rates, tuple(works), tuple(seconds))


def _rates():
    """This machine's rates now: micro-benchmarks, fitted to the model's own passes, with in-step links."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_llm.planning.calibration import calibrate
    from lightning_llm.planning.in_step import in_step_rates
    from lightning_llm.strategies.layout_rates import block_unit

    cpu = torch.device("cpu")
    rates = _fitted(calibrate(tokens=GLOBAL_BATCH * 256, hidden=256, width=256, dtype=torch.float32, device=cpu))
    mesh = init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        module = _model(256)
        module.configure_model()
    unit = block_unit(module)  # ZeRO's stand-in units shaped like the dense model's blocks
    return in_step_rates(rates, mesh, tokens=GLOBAL_BATCH * 256, hidden=256, width=704, device=cpu, unit=unit)


def _grid(rounds: int, steps: int, names: list[str]) -> dict | None:
    """Per cell, per round: (predicted seconds at the round's calibration, measured seconds). The machine's speed
    drifts by tens of percent over minutes (a shared host), so each round calibrates just before its cells."""
    import torch.distributed as dist

    from lightning_llm.planning.step_time import step_time

    cells = [(name, seq_len) for name in names for seq_len in SEQ_LENS]
    works = {cell: _work(*cell) for cell in cells}
    results: dict = {cell: [] for cell in cells}
    for _ in range(rounds):  # alternated: each round calibrates, then runs every cell once
        rates = _rates()
        for cell in cells:
            work, layout, params, tensors, experts = works[cell]
            predicted = step_time(
                work, layout, rates, rank_params=params, rank_tensors=tensors, rank_expert_params=experts
            ).total
            results[cell].append((predicted, _measure(*cell, steps)))
    return results if dist.get_rank() == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), metavar="NAME")
    args = parser.parse_args()
    results = run_distributed(_grid, 2, args.rounds, args.steps, args.layouts, timeout=3000)[0]
    print(
        "| layout | tokens | predicted ms (median) | measured ms (median, min-max) | predicted / measured (median of rounds) |"
    )
    print("|---|---|---|---|---|")
    within = 0
    for (name, seq_len), rounds in results.items():
        predicted, measured = [p for p, _ in rounds], [m for _, m in rounds]
        ratio = statistics.median(p / m for p, m in rounds)
        within += abs(ratio - 1) <= 0.2
        print(
            f"| {name} | {seq_len} | {statistics.median(predicted) * 1e3:.0f} | {statistics.median(measured) * 1e3:.0f} "
            f"({min(measured) * 1e3:.0f}-{max(measured) * 1e3:.0f}) | {ratio:.2f} |"
        )
    print(f"{within} of {len(results)} cells within 20%")


if __name__ == "__main__":
    main()
