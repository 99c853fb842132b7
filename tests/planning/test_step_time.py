"""The step-time arithmetic against counts by hand (:mod:`lightning_llm.planning.step_time`)."""

from __future__ import annotations

import pytest

from lightning_llm.planning.step_time import Link, Rates, StepLayout, step_time
from lightning_llm.planning.work import ForwardWork, Work

# 1 GFLOP/s, 1 GB/s, no launch cost: a block's forward is 1 s of matmuls and 0.5 s of elementwise work.
RATES = Rates(matmul_flops=1e9, memory_bandwidth=1e9, op_overhead=0.0, link=Link(bandwidth=1e9, latency=0.0))


def _work(blocks: int = 2) -> ForwardWork:
    work = ForwardWork(
        [Work(matmul_flops=1e9, matmuls=4, other_bytes=5e8, ops=10) for _ in range(blocks)],
        Work(matmul_flops=0.0, other_bytes=0.0),
    )
    work.stream_bytes, work.attention_kv_bytes = 10**8, [2 * 10**8] * blocks
    return work


def test_ring_collectives_cost_what_a_ring_moves():
    link = Link(bandwidth=1e9, latency=1e-3)
    assert link.all_reduce(1e9, 4) == pytest.approx(2 * 3 * 1e-3 + 2 * 3 / 4)
    assert link.all_gather(1e9, 4) == pytest.approx(3 * 1e-3 + 3 / 4)
    assert link.all_reduce(1e9, 1) == 0.0
    in_step = Link(bandwidth=1e9, call_latency=5e-3)  # a collective's fixed cost inside a step, once per call
    assert in_step.all_reduce(1e9, 4) == pytest.approx(5e-3 + 2 * 3 / 4)
    assert in_step.all_gather(1e9, 4) == pytest.approx(5e-3 + 3 / 4)


def test_compute_is_three_forwards_and_full_checkpointing_adds_one():
    layout = StepLayout(world_size=1)
    plain = step_time(_work(), layout, RATES, rank_params=0)
    assert plain.compute == pytest.approx(3 * 2 * 1.5)  # forward 1.5 s per block, backward twice that
    full = step_time(_work(), StepLayout(world_size=1, activation_checkpointing="full"), RATES, rank_params=0)
    assert full.recompute == pytest.approx(2 * 1.5)
    selective = step_time(_work(), StepLayout(world_size=1, activation_checkpointing="selective"), RATES, rank_params=0)
    assert selective.recompute == pytest.approx(2 * 0.5)  # the elementwise part only
    work, moded = _work(), Rates(1e9, 1e9, 0.0, Link(1e9), mode_overhead=1e-3)
    for block in work.blocks:
        block.dispatches = 25  # its policy sees each op (views too) in forward and in the recompute
    selective = step_time(work, StepLayout(world_size=1, activation_checkpointing="selective"), moded, rank_params=0)
    assert selective.recompute == pytest.approx(2 * 0.5 + 2 * 2 * 25 * 1e-3)


def test_zero_stages_communicate_what_fsdp_moves():
    params = 1e8  # fp32: 0.4 GB gathered and reduced over 2 ranks: (n-1)/n = 1/2 of it per collective
    times = {
        stage: step_time(_work(), StepLayout(world_size=2, zero_stage=stage), RATES, rank_params=params).data_parallel
        for stage in (0, 2, 3)
    }
    assert times[0] == pytest.approx(2 * 0.5 * 0.4)  # one all-reduce of the gradients
    assert times[2] == pytest.approx(0.2 + 0.2)  # one all-gather, one reduce-scatter
    assert times[3] == pytest.approx(2 * 0.2 + 0.2)  # all-gathered again for backward
    # FSDP2 makes each collective once per unit (2 blocks and the root): a per-call cost counts 3 times per kind
    per_call = Rates(1e9, 1e9, 0.0, Link(bandwidth=1e9, call_latency=1e-3))
    zero3 = step_time(_work(), StepLayout(world_size=2, zero_stage=3), per_call, rank_params=params).data_parallel
    assert zero3 == pytest.approx(times[3] + 3 * 3 * 1e-3)


def test_gradients_are_reduced_once_per_step_where_whole_and_per_micro_batch_where_sharded_pipelined_or_not():
    params = 1e8  # fp32: 0.4 GB over 2 data-parallel ranks, (n-1)/n = 1/2 of it per collective

    def data_parallel(**layout) -> float:
        return step_time(_work(), StepLayout(**layout), RATES, rank_params=params).data_parallel

    # accumulating 4 micro-batches: ZeRO 0 all-reduces once; ZeRO 3 gathers twice and reduce-scatters per micro-batch
    assert data_parallel(world_size=2, zero_stage=0, micro_batches=4) == pytest.approx(2 * 0.5 * 0.4)
    assert data_parallel(world_size=2, zero_stage=3, micro_batches=4) == pytest.approx(4 * (2 * 0.2 + 0.2))
    # a pipeline's micro-batches alike, over every schedule run of the step
    assert data_parallel(world_size=4, pp=2, zero_stage=0, micro_batches=4) == pytest.approx(2 * 0.5 * 0.4)
    assert data_parallel(world_size=4, pp=2, zero_stage=0, micro_batches=4, pipeline_steps=2) == pytest.approx(0.4)
    assert data_parallel(world_size=4, pp=2, zero_stage=3, micro_batches=4) == pytest.approx(4 * (2 * 0.2 + 0.2))
    assert data_parallel(world_size=4, pp=2, zero_stage=2, micro_batches=2, pipeline_steps=2) == pytest.approx(
        4 * (0.2 + 0.2)
    )


def test_each_zero_stage_is_priced_at_its_own_in_step_link_where_calibrated():
    params, units = 1e8, 3  # 2 blocks and the root
    zero0, zero3 = Link(bandwidth=1e9, call_latency=4e-3), Link(bandwidth=1e9, call_latency=1e-3)
    rates = Rates(1e9, 1e9, 0.0, Link(bandwidth=1e9), dp_link=zero3, zero_links={0: zero0, 3: zero3})
    got = {s: step_time(_work(), StepLayout(world_size=2, zero_stage=s), rates, rank_params=params).data_parallel
           for s in (0, 2, 3)}  # fmt: skip
    assert got[0] == pytest.approx(0.4 + units * 4e-3)  # all-reduces at ZeRO 0's cost per call
    assert got[3] == pytest.approx(0.6 + units * 3 * 1e-3)
    assert got[2] == pytest.approx(0.4 + units * 2 * 1e-3)  # no link of its own: dp_link's


def test_a_calibrated_optimizer_costs_per_tensor_and_per_parameter_of_its_shard():
    rates = Rates(1e9, 1e9, 0.0, Link(1e9), optimizer_per_tensor=1e-3, optimizer_per_param=1e-9)
    one = step_time(_work(), StepLayout(world_size=1), rates, rank_params=1e8, rank_tensors=40).optimizer
    assert one == pytest.approx(40 * 1e-3 + 1e8 * 1e-9)
    sharded = step_time(_work(), StepLayout(world_size=4, zero_stage=3), rates, rank_params=1e8, rank_tensors=40)
    assert sharded.optimizer == pytest.approx(40 * 1e-3 + 1e8 / 4 * 1e-9)  # every tensor, a quarter of each
    table = step_time(_work(), StepLayout(world_size=1), RATES, rank_params=1e8, rank_tensors=40).optimizer
    assert table == pytest.approx(1e8 * 4 * 4 * 2 / 1e9)  # uncalibrated: memory-bound, no per-tensor cost


def test_a_pipeline_runs_m_plus_pp_minus_one_slots_of_its_slowest_stage():
    layout = StepLayout(world_size=2, pp=2, micro_batches=4)
    got = step_time(_work(), layout, RATES, rank_params=0)
    stage_forward = 2 * 1.5 / 2  # half the blocks
    assert got.compute == pytest.approx((4 + 1) * 3 * stage_forward)
    assert got.pipeline == pytest.approx((4 + 1) * 2 * 0.1)  # the hidden states forward, their gradient back
    interleaved = step_time(
        _work(), StepLayout(world_size=2, pp=2, micro_batches=4, virtual_stages=2), RATES, rank_params=0
    )
    assert interleaved.compute == pytest.approx((4 + 0.5) * 3 * stage_forward)
    accumulated = step_time(
        _work(), StepLayout(world_size=2, pp=2, micro_batches=4, pipeline_steps=3), RATES, rank_params=0
    )
    assert accumulated.compute == pytest.approx(3 * (4 + 1) * 3 * stage_forward)  # a bubble per schedule run


def test_context_parallelism_divides_compute_and_passes_keys_and_values_round_the_ring():
    got = step_time(_work(), StepLayout(world_size=2, cp=2), RATES, rank_params=0)
    assert got.compute == pytest.approx(3 * 2 * 1.5 / 2)
    # per block: this rank's half of K/V (0.1 GB) passed cp - 1 = 1 time forward, twice in backward
    assert got.context_parallel == pytest.approx(2 * 3 * 0.1)


def test_expert_parallelism_moves_each_routed_row_by_all_to_all_and_launches_a_share_of_the_experts_ops():
    work = _work()
    work.experts = [Work(matmul_flops=5e8, matmuls=2, ops=8) for _ in work.blocks]  # part of each block's work
    work.routed_bytes = [10**9, 10**9]  # each block's MoE call receives 1 GB of rows (tokens x k x width)
    per_op = Rates(1e9, 1e9, 1e-3, Link(bandwidth=1e9, call_latency=1e-2))
    dense = step_time(work, StepLayout(world_size=4, zero_stage=0), per_op, rank_params=0)
    ep = step_time(work, StepLayout(world_size=4, zero_stage=0, ep=4), per_op, rank_params=0)
    # per block and pass: 3/4 of the 8 expert ops fewer, 20 dispatch ops more, at 1 ms each (backward twice)
    assert ep.compute - dense.compute == pytest.approx(2 * 3 * (20 - 0.75 * 8) * 1e-3)
    # per block: 4 data all-to-alls (dispatch and combine, forward and backward) of 3/4 GB, one of the counts
    assert ep.expert_parallel == pytest.approx(2 * (4 * (1e-2 + 0.75) + 1e-2))
    full = step_time(work, StepLayout(world_size=4, ep=4, activation_checkpointing="full"), per_op, rank_params=0)
    assert full.expert_parallel == pytest.approx(2 * (6 * (1e-2 + 0.75) + 2 * 1e-2))  # the recompute dispatches again
    assert dense.expert_parallel == 0.0


def test_experts_are_reduced_over_the_ranks_that_hold_the_same_experts():
    """Under expert parallelism each block's experts are an FSDP2 unit over the ``dp / ep`` ranks holding the same
    experts: at ``ep = dp`` nobody else holds them (no collective), at ``ep = dp / 2`` a pair does."""
    work = _work()
    work.routed_bytes = [10**9, 10**9]
    link = Link(bandwidth=1e9, call_latency=1e-2)
    rates = Rates(1e9, 1e9, 0.0, link, optimizer_per_param=1e-9)
    # 4e8 parameters on a rank, 1e8 of them experts (1/ep of the experts), fp32 gradients
    ep4 = step_time(work, StepLayout(world_size=4, ep=4), rates, rank_params=4e8, rank_expert_params=1e8)
    dense = 3 * (1e-2 + 2 * 3 / 4 * 12e8 / 3 / 1e9)  # 2 blocks + the root: 3 all-reduces of 1.2 GB / 3 over 4 ranks
    assert ep4.data_parallel == pytest.approx(dense)
    ep2 = step_time(work, StepLayout(world_size=4, ep=2), rates, rank_params=4e8, rank_expert_params=1e8)
    experts = 2 * (1e-2 + 2 * 1 / 2 * 4e8 / 2 / 1e9)  # each block's experts: one all-reduce of 0.2 GB over 2 ranks
    assert ep2.data_parallel == pytest.approx(dense + experts)
    zero2 = step_time(
        work, StepLayout(world_size=4, ep=2, zero_stage=2), rates, rank_params=4e8, rank_expert_params=1e8
    )
    assert zero2.optimizer == pytest.approx((3e8 / 4 + 1e8 / 2) * 1e-9)  # each sharded over the ranks holding it


def test_a_parameter_read_in_parts_fills_a_whole_gradient_per_part_in_backward():
    work = _work()
    for block in work.blocks:
        block.backward_bytes = 1e9
    work.experts = [Work(backward_bytes=6e8) for _ in work.blocks]  # 0.6 GB of it the experts' stacked weights
    plain = step_time(_work(), StepLayout(world_size=2, zero_stage=0), RATES, rank_params=0).compute
    dense = step_time(work, StepLayout(world_size=2, zero_stage=0), RATES, rank_params=0).compute
    assert dense - plain == pytest.approx(2 * 1.0)  # 1 GB a block at 1 GB/s
    ep = step_time(work, StepLayout(world_size=2, zero_stage=0, ep=2), RATES, rank_params=0).compute
    assert ep - plain == pytest.approx(2 * (0.6 / 4 + 0.4))  # half the experts, each half the size
    filling = Rates(1e9, 1e9, 0.0, Link(1e9), fill_bandwidth=5e8)  # fresh weight-sized tensors fill at half the rate
    slow = step_time(work, StepLayout(world_size=2, zero_stage=0), filling, rank_params=0).compute
    assert slow - plain == pytest.approx(2 * 2.0)


def test_tensor_parallel_collectives_are_priced_per_call():
    work = _work()
    work.collectives = [("forward", "all_reduce", 10**9, 0), ("backward", "all_gather", 10**9, 0)]
    got = step_time(work, StepLayout(world_size=2, tp=2), RATES, rank_params=0)
    assert got.tensor_parallel == pytest.approx(2 * 0.5 + 0.5)


def test_overlapped_communication_is_exposed_only_beyond_compute():
    overlapping = Rates(1e9, 1e9, 0.0, Link(1e9), overlap=True)
    got = step_time(_work(), StepLayout(world_size=2, zero_stage=3), overlapping, rank_params=1e8)
    assert got.data_parallel == 0.0  # 0.6 s of gathers behind 9 s of compute
    huge = step_time(_work(), StepLayout(world_size=2, zero_stage=3), overlapping, rank_params=1e10)
    assert huge.data_parallel == pytest.approx(60 - 9)


def test_rates_fitted_to_two_timed_passes_recover_the_cost_per_op_and_the_slowdown():
    from lightning_llm.planning.calibration import fitted_to_model

    large, small = _work(), _work()  # the same 20 ops on twice and once the tokens: 3 and 1.5 s of work at RATES
    for block in small.blocks:
        block.matmul_flops, block.other_bytes = block.matmul_flops / 2, block.other_bytes / 2
    per_op, slowdown = 2e-3, 1.7
    seconds = tuple(3 * (20 * per_op + slowdown * work) for work in (1.5, 3.0))
    fitted = fitted_to_model(RATES, (small, large), seconds)
    assert fitted.op_overhead == pytest.approx(per_op)
    assert fitted.matmul_flops == pytest.approx(1e9 / slowdown)
    assert fitted.memory_bandwidth == pytest.approx(1e9 / slowdown)
    # the fitted rates predict both passes back
    for work, want in zip((small, large), seconds):
        assert step_time(work, StepLayout(world_size=1), fitted, rank_params=0).compute == pytest.approx(want)


def test_the_calibrated_optimizer_cost_predicts_an_adamw_step_of_other_tensors():
    """Calibrated on 32 tensors of 8 and of 65,536 elements; checked on 24 tensors of 20,000 elements (the measured
    step, median of 15, within a factor of 1.5: the host is shared; 0.87-0.98 in 8 runs here)."""
    import statistics
    import time

    import torch

    from lightning_llm.planning.in_step import optimizer_costs

    per_tensor, per_param = optimizer_costs(torch.device("cpu"))
    params = [torch.nn.Parameter(torch.zeros(20_000)) for _ in range(24)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    optimizer.step()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    predicted = 24 * per_tensor + 24 * 20_000 * per_param
    assert 1 / 1.5 <= predicted / statistics.median(times) <= 1.5


def _shared_and_alone() -> tuple[float, float | None]:
    import time

    import torch
    import torch.distributed as dist

    from lightning_llm.planning.calibration import _concurrent_seconds

    dist.init_process_group("gloo")
    a = torch.randn(192, 192)
    work = lambda: [a @ a for _ in range(30)]  # noqa: E731
    shared = _concurrent_seconds(work, torch.device("cpu"), window=0.5)
    dist.barrier()
    alone = None
    if dist.get_rank() == 0:  # the others wait; timed by hand, the quickest of 15 (a core to itself)
        times = []
        for _ in range(17):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        alone = min(times[2:])
    dist.barrier()
    return shared, alone


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_calibration_with_ranks_times_the_work_as_the_ranks_share_the_machine():
    """Every rank times the same matmuls together (``_concurrent_seconds``): with 4 single-threaded ranks on a host
    of ``cores`` cores each gets ``min(1, cores / 4)`` of one, so their mean time is ``max(1, 4 / cores)`` times
    rank 0's alone, while the others wait (its quickest of 15 repeats: a core to itself), within 0.65-1.6x of that
    (the host is shared). Timing each rank's quickest
    repeats instead, as one process's calibration does, credited each rank with a core of its own."""
    import os

    from lightning_llm.testing import run_distributed

    ranks = run_distributed(_shared_and_alone, 4, timeout=100)
    shared, alone = sum(r[0] for r in ranks) / 4, ranks[0][1]
    expected = max(1.0, 4 / len(os.sched_getaffinity(0)))
    assert 0.65 * expected <= shared / alone <= 1.6 * expected, ([r[0] for r in ranks], alone, expected)
