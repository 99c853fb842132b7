"""The planner's per-rank total (parameters, gradients, optimizer state, activations) against a measured step.

The oracle is torch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``): the peak bytes of one
real training step (forward, backward, AdamW step, after a first step created the optimizer state) on each of 2
ranks, with the model laid out by :func:`~lightning_llm.parallel.parallelize.parallelize` as the strategy lays it
out. The plan is :func:`~lightning_llm.planning.zero.estimate_options`' row for that ZeRO stage, from the
footprint measured on the whole model (fake tensors): what ``zero_stage="auto"`` decides from.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.testing import run_distributed

# Measured here: 0.94 to 1.00 of the peak. Without fsdp2_copies the plan was 16-21% short under "full".
STAGES, SEQ_LENS, POLICIES = (0, 1, 2, 3), (128, 256, 512), ("none", "full")
BATCH = 4


def _model():
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("small", n_layers=4, max_seq_len=512))
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    return module


def _measure_and_plan(cases: list[tuple[int, int, str]]) -> dict | None:
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize
    from lightning_llm.planning.zero import estimate_options
    from lightning_llm.strategies.zero_auto import model_footprint

    dims = ParallelDims(world_size=2)
    dims.build_mesh("cpu")
    results = {}
    for stage, seq_len, policy in cases:
        footprint = model_footprint(_model(), micro_batch_size=BATCH, seq_len=seq_len)
        rows = estimate_options(
            footprint.num_params,
            footprint.largest_block,
            footprint.activations_for(policy),
            outside_blocks=footprint.outside_blocks,
            world_size=2,
            allow_offload=False,
            optimizer_states=footprint.optimizer_states,
        )
        row_stage = 2 if stage == 1 else stage  # natively ZeRO 1 runs as ZeRO 2: the planner has one row for both
        planned = next(r for r in rows if r.zero_stage == row_stage and r.offload == "none").total
        module = _model()
        checkpointing = (
            None
            if policy == "none"
            else (lambda blocks, entries: apply_activation_checkpointing(blocks, mode=policy, entries=entries))
        )
        parallelize(module, dims, zero_stage=stage, activation_checkpointing=checkpointing)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        batch = torch.randint(0, 256, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(1))

        def step():
            module.training_step(batch, 0).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        step()  # the optimizer state exists from here on, as in every step but the first
        tracker = FSDPMemTracker(module.model, optimizer)
        with tracker:
            step()
        measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        results[(stage, seq_len, policy)] = (planned, measured)
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def totals():
    cases = [(stage, seq_len, policy) for stage in STAGES for seq_len in SEQ_LENS for policy in POLICIES]
    return run_distributed(_measure_and_plan, 2, cases, timeout=600)[0]


@pytest.mark.distributed
@pytest.mark.timeout(700)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seq_len", SEQ_LENS)
@pytest.mark.parametrize("stage", STAGES)
def test_planned_total_per_rank_is_within_15_percent_of_measured(totals, stage, seq_len, policy):
    planned, measured = totals[(stage, seq_len, policy)]
    assert 0.85 <= planned / measured <= 1.15, f"ZeRO {stage}, seq {seq_len}, AC {policy}: {planned=} {measured=}"
