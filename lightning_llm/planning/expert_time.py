"""Expert parallelism's part of a step's time (:mod:`.step_time`): the all-to-alls that carry each MoE call's routed
rows to their experts' ranks and back, and the launches a rank no longer makes (it runs ``1 / ep`` of the experts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llm.planning.work import ForwardWork, summed

if TYPE_CHECKING:
    from lightning_llm.planning.step_time import Rates, StepLayout

DISPATCH_OPS = 20  # ops expert parallelism adds per MoE call and forward: sorting, counting, indexing, weighting


def expert_parallel_costs(work: ForwardWork, layout: StepLayout, rates: Rates) -> tuple[float, float]:
    """(seconds one forward's launches change by, seconds of the all-to-alls of a forward and backward) of one
    micro-batch's MoE calls on one rank under ``layout.ep``. Example::

        launches, all_to_alls = expert_parallel_costs(work, StepLayout(world_size=4, ep=4), rates)
    """
    ep = layout.ep
    if ep == 1:
        return 0.0, 0.0
    calls = [b for b in work.routed_bytes if b]
    fewer = (1 - 1 / ep) * summed(work.experts).ops - DISPATCH_OPS * len(calls)
    # Plain collectives (no DTensor redistribution around them, as tensor parallelism's): the isolated link's cost.
    link = rates.link_over(ep * layout.tp * layout.cp)
    exchanges = 4 + (2 if layout.activation_checkpointing == "full" else 0)  # data all-to-alls per call
    counts = 1 + (layout.activation_checkpointing == "full")
    seconds = sum(exchanges * link.all_to_all(b, ep) + counts * link.all_to_all(0, ep) for b in calls)
    return -fewer * rates.op_overhead, seconds
