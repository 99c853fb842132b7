"""The planner's per-rank total (parameters, gradients, optimizer state, activations) against a measured step.

The oracle is torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``): the peak bytes of one
real training step (forward, backward, AdamW step, after a first step created the optimizer state) on each of 2
ranks, with the model laid out by :func:`~lightning_llm.parallel.parallelize.parallelize` as the strategy lays it
out. The plan is :func:`~lightning_llm.planning.zero.estimate_options`' row for that ZeRO stage, from the
footprint measured on the whole model (fake tensors): what ``zero_stage="auto"`` decides from.

Under tensor parallelism (tp=2, with and without sequence parallelism) the footprint's activations are one rank's,
read from the model's dataflow under its plan (:mod:`lightning_llm.modeling.tp_shares`); the oracle is torch's
``MemTracker`` on the tp-split model. Dividing the whole model's activations by tp, as the plan did before, came to
0.73-0.86 of the measured total there.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.testing import run_distributed

# Measured here: 0.94 to 1.00 of the peak. Without fsdp2_copies the plan was 16-21% short under "full".
STAGES, SEQ_LENS, POLICIES = (0, 1, 2, 3), (128, 256, 512), ("none", "full")
TP_CASES = [(sequence_parallel, policy) for sequence_parallel in (False, True) for policy in ("none", "full")]
TP_SEQ_LEN = 512  # measured here: 0.96 to 0.98 of the peak
BATCH = 4


def _model():
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("small", n_layers=4, max_seq_len=512))
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    return module


def _planned(seq_len: int, policy: str, stage: int, tp: int = 1, sequence_parallel: bool = False) -> float:
    from lightning_llm.planning.zero import estimate_options
    from lightning_llm.strategies.zero_auto import model_footprint

    footprint = model_footprint(
        _model(), micro_batch_size=BATCH, seq_len=seq_len, tp=tp, sequence_parallel=sequence_parallel
    )
    rows = estimate_options(
        footprint.num_params,
        footprint.largest_block,
        footprint.activations_for(policy),
        outside_blocks=footprint.outside_blocks,
        world_size=2,
        tp=tp,
        allow_offload=False,
        optimizer_states=footprint.optimizer_states,
        activations_tp=footprint.activations_tp,
    )
    row_stage = 2 if stage == 1 else stage  # natively ZeRO 1 runs as ZeRO 2: the planner has one row for both
    return next(r for r in rows if r.zero_stage == row_stage and r.offload == "none").total


def _measured(dims, seq_len: int, policy: str, stage: int, sequence_parallel: bool = False) -> int:
    from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_llm.parallel.parallelize import parallelize
    from lightning_llm.testing.memory import step_peak

    module = _model()
    checkpointing = (
        None
        if policy == "none"
        else (lambda blocks, entries: apply_activation_checkpointing(blocks, mode=policy, entries=entries))
    )
    parallelize(
        module, dims, zero_stage=stage, activation_checkpointing=checkpointing, sequence_parallel=sequence_parallel
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    batch = torch.randint(0, 256, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(1))
    return step_peak(module, optimizer, batch, fsdp_root=module.model if dims.tp == 1 else None)


def _measure_and_plan(cases: list[tuple[int, int, str]], tp_cases: list[tuple[bool, str]]) -> dict | None:
    import torch.distributed as dist

    from lightning_llm.parallel.mesh import ParallelDims

    dims = ParallelDims(world_size=2)
    dims.build_mesh("cpu")
    results = {}
    for stage, seq_len, policy in cases:
        results[(stage, seq_len, policy)] = (_planned(seq_len, policy, stage), _measured(dims, seq_len, policy, stage))
    dims = ParallelDims(world_size=2, tp=2)
    dims.build_mesh("cpu")
    for sequence_parallel, policy in tp_cases:
        planned = _planned(TP_SEQ_LEN, policy, 0, tp=2, sequence_parallel=sequence_parallel)
        results[("tp", sequence_parallel, policy)] = (
            planned,
            _measured(dims, TP_SEQ_LEN, policy, 0, sequence_parallel=sequence_parallel),
        )
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def totals():
    cases = [(stage, seq_len, policy) for stage in STAGES for seq_len in SEQ_LENS for policy in POLICIES]
    return run_distributed(_measure_and_plan, 2, cases, TP_CASES, timeout=600)[0]


@pytest.mark.distributed
@pytest.mark.timeout(700)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("stage", STAGES)
def test_planned_total_per_rank_is_within_15_percent_of_measured(totals, stage, seq_len, policy):
    planned, measured = totals[(stage, seq_len, policy)]
    assert 0.85 <= planned / measured <= 1.15, f"ZeRO {stage}, seq {seq_len}, AC {policy}: {planned=} {measured=}"


@pytest.mark.distributed
@pytest.mark.timeout(700)
@pytest.mark.parametrize(("sequence_parallel", "policy"), TP_CASES)
def test_planned_total_per_rank_under_tensor_parallelism_is_within_10_percent(totals, sequence_parallel, policy):
    planned, measured = totals[("tp", sequence_parallel, policy)]
    assert 0.9 <= planned / measured <= 1.1, f"tp=2, SP {sequence_parallel}, AC {policy}: {planned=} {measured=}"
