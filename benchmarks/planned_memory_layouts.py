"""The planner's per-rank total against torch's MemTracker under tensor parallelism (2 gloo ranks, CPU).

Each case plans the ``small`` reference model (4 blocks, batch 4) for tp=2 as ``zero_stage="auto"`` would
(:func:`model_footprint` with ``tp=2``: each rank's share read from the dataflow, then :func:`estimate_options`),
lays the model out with :func:`parallelize` (with and without sequence parallelism), runs one step to create the
optimizer state, and measures the peak of the next step with ``MemTracker``. ``tests/planning/test_planned_totals.py``
holds the 512-token rows within 10% and ZeRO 0-3 on data parallelism within 15%; the table is in ``docs/plan.md``.

    python benchmarks/planned_memory_layouts.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from lightning_llm.testing import run_distributed

BATCH = 4


def _model():
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("small", n_layers=4, max_seq_len=512))
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    return module


def _measure(cases: list[tuple[bool, int, str]]) -> dict | None:
    import torch.distributed as dist

    from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize
    from lightning_llm.planning.zero import estimate_options
    from lightning_llm.strategies.zero_auto import model_footprint
    from lightning_llm.testing.memory import step_peak

    dims = ParallelDims(world_size=2, tp=2)
    dims.build_mesh("cpu")
    results = {}
    for sequence_parallel, seq_len, policy in cases:
        footprint = model_footprint(
            _model(), micro_batch_size=BATCH, seq_len=seq_len, tp=2, sequence_parallel=sequence_parallel
        )
        rows = estimate_options(
            footprint.num_params,
            footprint.largest_block,
            footprint.activations_for(policy),
            outside_blocks=footprint.outside_blocks,
            world_size=2,
            tp=2,
            allow_offload=False,
            optimizer_states=footprint.optimizer_states,
            activations_tp=footprint.activations_tp,
        )
        planned = next(r for r in rows if r.zero_stage == 0).total
        module = _model()
        checkpointing = (
            None
            if policy == "none"
            else (lambda blocks, entries: apply_activation_checkpointing(blocks, mode=policy, entries=entries))
        )
        parallelize(
            module, dims, zero_stage=0, activation_checkpointing=checkpointing, sequence_parallel=sequence_parallel
        )
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        batch = torch.randint(0, 256, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(1))
        results[(sequence_parallel, seq_len, policy)] = (
            planned,
            step_peak(module, optimizer, batch),
        )
    return results if dist.get_rank() == 0 else None


def main() -> None:
    cases = [(sp, seq_len, policy) for sp in (False, True) for seq_len in (256, 512) for policy in ("none", "full")]
    results = run_distributed(_measure, 2, cases, timeout=600)[0]
    print("| tp=2 | sequence parallel | tokens | AC | planned MiB | measured MiB | planned / measured |")
    print("|---|---|---|---|---|---|---|")
    for (sp, seq_len, policy), (planned, measured) in results.items():
        print(
            f"| 2 | {sp} | {seq_len} | {policy} | {planned / 2**20:.1f} | {measured / 2**20:.1f} | {planned / measured:.3f} |"
        )


if __name__ == "__main__":
    main()
