"""Step time of a layout: compute from the recorded work at the device's rates, communication from bytes and link
rates, the pipeline's bubble, recomputation and the optimizer step. Arithmetic only.

The work is one micro-batch's forward on one rank (:class:`~lightning_llm.planning.work.ForwardWork`, recorded by :mod:`lightning_llm.modeling.op_work`
on fake tensors with the rank's tensor-parallel share). The model, per rank and micro-batch:

* **compute**: forward = ops x launch overhead + matmul FLOPs / matmul rate + other bytes / memory bandwidth; backward
  twice the forward (a matmul's backward is two matmuls; an elementwise op's reads the saved input and the gradient
  and writes one); context parallelism divides the FLOPs and bytes by ``cp`` (each rank runs its share of the
  sequence, attention's queries included), not the ops each rank launches;
  plus what only the backward moves: a parameter read in parts (an expert's slice of stacked weights, an embedding's
  rows) gets each part's gradient as a zero-filled whole, added into its gradient;
* **recompute**: "full" checkpointing runs every block's forward again; "selective" its ops other than matmuls;
* **tensor parallelism**: the recorded collectives (torch's styles: row splits all-reduce or reduce-scatter, column
  splits all-gather under sequence parallelism, and their backward mirrors), on the critical path;
* **context parallelism**: the ring passes each rank's keys and values ``cp - 1`` times per attention call, twice
  that in backward;
* **ZeRO** (FSDP2 over ``dp x cp`` ranks, one collective per unit: each block and the root; under expert parallelism
  each block's experts too, over the ``dp x cp / ep`` ranks holding them): stage 3 all-gathers the
  parameters in forward and again in backward, stage 2 once; stages 1-3 reduce-scatter the gradients, stage 0
  all-reduces them; where the device overlaps
  communication with compute (CUDA streams), only what exceeds the compute is exposed;
* **expert parallelism** (``ep`` ranks of the data-parallel group share each MoE layer's experts;
  :mod:`.expert_time`): each MoE call
  sends its routed rows (one per token and chosen expert) to their experts' ranks and back, ``(ep - 1) / ep`` of them
  off the rank, by all-to-all (a small exchange of counts first); backward does the two data exchanges again, and a
  fully checkpointed block's recompute the forward's. A rank launches ``1 / ep`` of the experts' ops (the experts'
  FLOPs stay: ``ep`` ranks' rows reach its experts) and the dispatch's own ops;
* **pipeline**: ``(m + pp - 1) / v`` stage slots for ``m`` micro-batches, the slowest stage's time per slot (the last
  holds the head and loss), plus a send of the hidden states per micro-batch and boundary;
* **optimizer**: AdamW reads and writes parameters, gradients and two moments once: memory-bound; where calibrated,
  a measured cost per parameter tensor (a DTensor's dispatch per op) and per parameter instead.

Collectives cost ``latency x steps + bytes x factor / bandwidth`` (ring: all-reduce ``2(n-1)/n``, all-gather and
reduce-scatter and all-to-all ``(n-1)/n`` of the whole tensor). Not modelled: uneven routing (each expert's rank is
priced at the mean load), kernel fusion by ``torch.compile``, and contention between ranks sharing a host's cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_llm.planning.expert_time import expert_parallel_costs
from lightning_llm.planning.work import ForwardWork, Work, summed


@dataclass(frozen=True)
class Link:
    """A process group's collectives: ``bandwidth`` bytes/s per rank, ``latency`` seconds per ring step, and
    ``call_latency`` seconds per collective (what a collective inside a step costs whatever its size: the framework's
    work around it and the wait for the slower rank)."""

    bandwidth: float
    latency: float = 0.0
    call_latency: float = 0.0

    def all_reduce(self, nbytes: float, n: int) -> float:
        if n == 1:
            return 0.0
        return self.call_latency + 2 * (n - 1) * self.latency + 2 * (n - 1) / n * nbytes / self.bandwidth

    def all_gather(self, nbytes: float, n: int) -> float:
        """Also a reduce-scatter's time: ``nbytes`` is the whole (gathered) tensor."""
        if n == 1:
            return 0.0
        return self.call_latency + (n - 1) * self.latency + (n - 1) / n * nbytes / self.bandwidth

    def all_to_all(self, nbytes: float, n: int) -> float:
        """``nbytes``: a rank's whole buffer, of which ``(n - 1) / n`` leaves it."""
        return self.all_gather(nbytes, n)

    def send(self, nbytes: float) -> float:
        return self.call_latency + self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Rates:
    """What a device and its links achieve (measured by :mod:`lightning_llm.planning.calibration` or from its table).

    Attributes:
        matmul_flops: FLOP/s the model's matmuls reach.
        memory_bandwidth: bytes/s elementwise ops move.
        op_overhead: seconds each op costs beyond its work (dispatch, autograd, kernel launch).
        link: the collectives between ranks of one node (or of every group, without ``network``).
        overlap: whether data-parallel and context-parallel communication runs beside compute (CUDA streams).
        network: the collectives of a group spanning nodes of ``node_size`` ranks.
        tp_link, dp_link: tensor parallelism's and ZeRO's collectives as measured inside a step (DTensor's and FSDP2's
            own costs and the wait for the slower rank included), where calibrated; else ``link``/``network``.
            Context parallelism's ring hops run inside the step too and use ``tp_link``.
        mode_overhead: seconds selective checkpointing's dispatch mode adds per op and pass (it sees every op of a
            block's forward and of its recompute).
        zero_links: ZeRO stage -> its collectives as FSDP2 meets them in a step (per collective and per byte, the
            gradient copies and divisions around them included), where calibrated; else ``dp_link``.
        optimizer_per_tensor, optimizer_per_param: seconds of the optimizer step per parameter tensor and per
            parameter, where calibrated (:mod:`.in_step`); else the step is priced as memory-bound.
        fill_bandwidth: bytes/s of zero-filling a fresh weight-sized gradient and adding it into another, where
            calibrated; else ``memory_bandwidth``.
    """

    matmul_flops: float
    memory_bandwidth: float
    op_overhead: float
    link: Link
    overlap: bool = False
    network: Link | None = None
    node_size: int = 8
    tp_link: Link | None = None
    dp_link: Link | None = None
    mode_overhead: float = 0.0
    zero_links: dict[int, Link] | None = None
    optimizer_per_tensor: float = 0.0
    optimizer_per_param: float | None = None
    fill_bandwidth: float | None = None

    def link_over(self, span: int) -> Link:
        """The link of a group whose ranks lie within ``span`` consecutive ranks (mesh order pp, dp, cp, tp)."""
        return self.network if self.network is not None and span > self.node_size else self.link


@dataclass(frozen=True)
class StepLayout:
    """One candidate: the parallel sizes, ZeRO stage, checkpointing and micro-batching of a step.

    ``micro_batches``: forwards per optimizer step on each rank (gradient accumulation, or the pipeline's micro-batches).
    ``ep``: expert-parallel ranks, carved from the data-parallel ones. ``pipeline_steps``: pipeline schedules run per
    optimizer step (the Trainer's gradient accumulation over a pipeline; without one, accumulation is
    ``micro_batches``).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero_stage: int = 0
    activation_checkpointing: str = "none"
    micro_batches: int = 1
    sequence_parallel: bool = False
    virtual_stages: int = 1
    ep: int = 1
    pipeline_steps: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part; ``total`` is what a step takes."""

    compute: float
    recompute: float
    tensor_parallel: float
    context_parallel: float
    data_parallel: float
    pipeline: float
    optimizer: float
    expert_parallel: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.expert_parallel
            + self.compute
            + self.recompute
            + self.tensor_parallel
            + self.context_parallel
            + self.data_parallel
            + self.pipeline
            + self.optimizer
        )


def work_time(work: Work, rates: Rates, share: float = 1.0, part: str = "all") -> float:
    """Seconds of one forward of ``work`` when this rank does ``share`` of its FLOPs and bytes but launches all its
    ops (context parallelism: every op on a shard of the sequence); ``part``: "all", "matmuls" or "others"."""
    matmul = share * work.matmul_flops / rates.matmul_flops + work.matmuls * rates.op_overhead
    other = share * work.other_bytes / rates.memory_bandwidth + (work.ops - work.matmuls) * rates.op_overhead
    return {"all": matmul + other, "matmuls": matmul, "others": other}[part]


def step_time(
    work: ForwardWork,
    layout: StepLayout,
    rates: Rates,
    *,
    rank_params: float,
    param_bytes: int = 4,
    gather_bytes: int = 4,
    rank_tensors: int = 0,
    rank_expert_params: float = 0.0,
) -> StepTime:
    """Predicted seconds of one optimizer step of ``layout`` (see the module doc).

    ``work``: one micro-batch's forward on one rank, with the layout's tensor-parallel share (context parallelism is
    applied here). ``rank_params``: parameters this rank holds before ZeRO's sharding (the model over ``tp x pp``).
    ``param_bytes``: bytes per parameter of the optimizer's tensors; ``gather_bytes``: per gathered parameter.
    ``rank_tensors``: parameter tensors this rank's optimizer steps (each costs ``rates.optimizer_per_tensor``).
    Under expert parallelism ``rank_params`` counts ``1 / ep`` of the experts' parameters, ``rank_expert_params``
    of them: their units are reduced over the ``dp x cp / ep`` ranks holding the same experts (none at ``ep = dp``).

    Example::

        step_time(work, StepLayout(world_size=2, zero_stage=3), rates, rank_params=124e6).total
    """
    m, cp, pp = layout.micro_batches, layout.cp, layout.pp
    blocks, outside = summed(work.blocks), work.outside
    launches, ep_seconds = expert_parallel_costs(work, layout, rates)
    stage_forward = (work_time(blocks, rates, 1 / cp) + launches) / pp + work_time(outside, rates, 1 / cp)
    recomputed_launches = launches if layout.activation_checkpointing == "full" else 0.0
    stage_recompute = (_recompute(blocks, layout.activation_checkpointing, rates, 1 / cp) + recomputed_launches) / pp
    tp_seconds = _tensor_parallel(work, layout, rates) / pp
    cp_seconds = _context_parallel(work, layout, rates) / pp
    slots = layout.pipeline_steps * (m + (pp - 1) / layout.virtual_stages)  # the bubble: pp - 1 slots over v stages
    fills = _backward_fills(work, layout) / (rates.fill_bandwidth or rates.memory_bandwidth)
    compute = slots * (3 * stage_forward + fills)
    recompute = slots * stage_recompute
    tensor_parallel = slots * tp_seconds
    hidden_states = work.stream_bytes / cp / (layout.tp if layout.sequence_parallel else 1)
    send = rates.link_over(layout.world_size).send(hidden_states)
    sends = 0.0 if pp == 1 else slots * 2 * send  # the forward's output, and backward's gradient
    moe_calls = sum(1 for b in work.routed_bytes if b) if layout.ep > 1 else 0
    n = layout.dp * cp  # the ranks sharding a parameter; an expert's: those of them holding the same experts
    dense = rank_params - rank_expert_params
    data_parallel = _data_parallel(layout, rates, dense, gather_bytes, param_bytes, len(work.blocks) / pp + 1, n)
    if moe_calls:  # FSDP2 units of their own: each block's experts
        expert_units, n_experts = moe_calls / pp, n // layout.ep
        data_parallel += _data_parallel(
            layout, rates, rank_expert_params, gather_bytes, param_bytes, expert_units, n_experts
        )
    context_parallel = slots * cp_seconds
    if rates.overlap:  # FSDP's prefetch runs beside all compute, the ring's next hop beside this hop's attention
        attention = slots * 3 * sum(work.attention_flops) / cp / pp / rates.matmul_flops
        data_parallel = max(0.0, data_parallel - compute - recompute)
        context_parallel = max(0.0, context_parallel - attention)
    shard = n if layout.zero_stage > 0 else 1
    stepped = dense / shard + rank_expert_params / max(shard // layout.ep, 1)  # parameters this rank's optimizer steps
    optimizer = rank_tensors * rates.optimizer_per_tensor
    if rates.optimizer_per_param is not None:
        optimizer += stepped * rates.optimizer_per_param
    else:  # param, grad, 2 moments read and written once
        optimizer += stepped * param_bytes * 4 * 2 / rates.memory_bandwidth
    expert_parallel = slots * ep_seconds / pp
    return StepTime(
        compute, recompute, tensor_parallel, context_parallel, data_parallel, sends, optimizer, expert_parallel
    )


def _recompute(blocks: Work, policy: str, rates: Rates, share: float) -> float:
    if policy == "full":
        return work_time(blocks, rates, share)
    if policy == "selective":  # keeps the matmuls' and attention's outputs; its policy sees every op twice
        return work_time(blocks, rates, share, part="others") + 2 * blocks.dispatches * rates.mode_overhead
    return 0.0


def _tensor_parallel(work: ForwardWork, layout: StepLayout, rates: Rates) -> float:
    """Seconds of one micro-batch's tensor-parallel collectives (forward and backward), per rank."""
    seconds, link = 0.0, rates.tp_link or rates.link_over(layout.tp)
    for _phase, kind, nbytes, _block in work.collectives:
        size = nbytes / layout.cp
        if kind == "all_reduce":
            seconds += link.all_reduce(size, layout.tp)
        else:
            seconds += link.all_gather(size, layout.tp)
    return seconds


def _backward_fills(work: ForwardWork, layout: StepLayout) -> float:
    """Bytes one micro-batch's backward on a stage fills and adds beyond twice the forward: each parameter read in
    parts gets each part's gradient as a zero-filled whole (this rank's shard of it). An experts module's stacked
    weights are split by expert under tp or ep: a rank reads ``1 / (tp ep)`` of the experts, each of a weight
    ``1 / (tp ep)`` the size."""
    blocks, experts = summed(work.blocks).backward_bytes, summed(work.experts).backward_bytes
    split = layout.tp * layout.ep
    return (experts / split**2 + (blocks - experts) / layout.tp) / layout.pp + work.outside.backward_bytes / layout.tp


def _context_parallel(work: ForwardWork, layout: StepLayout, rates: Rates) -> float:
    """Seconds of one micro-batch's ring passes: ``cp - 1`` hops of this rank's keys and values per attention call,
    twice that in backward (keys and values, then their gradients, go round)."""
    if layout.cp == 1:
        return 0.0
    link = rates.tp_link or rates.link_over(layout.tp * layout.cp)
    return sum(3 * (layout.cp - 1) * link.send(kv / layout.cp) for kv in work.attention_kv_bytes if kv)


def _data_parallel(
    layout: StepLayout, rates: Rates, rank_params: float, gather_bytes: int, param_bytes: int, units: float, n: int
) -> float:
    """Seconds of ZeRO's collectives per step over the ``n`` ranks sharding each of ``rank_params`` parameters (the
    ``dp x cp`` ranks; an expert's, ``dp x cp / ep``): their bytes in ``units`` collectives of each kind (one per
    FSDP2 unit).

    Gradients are reduced once per step where they are whole on every rank (ZeRO 0 accumulates locally and
    all-reduces at the last micro-batch); at ZeRO 1-3 each micro-batch reduce-scatters, to keep gradients sharded,
    and at ZeRO 3 gathers the parameters for its forward and its backward. A pipeline's micro-batches count as
    accumulation's do (``accumulation_sync``'s default, :mod:`lightning_llm.strategies.pipelined_steps`)."""
    if n == 1:
        return 0.0
    gathered, grads = rank_params * gather_bytes, rank_params * param_bytes
    m, link = (
        layout.micro_batches * layout.pipeline_steps,
        rates.dp_link or rates.link_over(layout.dp * layout.cp * layout.tp),
    )
    link = (rates.zero_links or {}).get(layout.zero_stage, link)
    if layout.zero_stage == 0:
        return units * link.all_reduce(grads / units, n)
    gathers, reductions = {1: 1, 2: 1, 3: 2}[layout.zero_stage] * m, m
    return units * (gathers * link.all_gather(gathered / units, n) + reductions * link.all_gather(grads / units, n))
