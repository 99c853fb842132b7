"""``layout="auto"``: every layout that fits the world, the model and the device memory, priced in seconds per step;
the fastest is chosen.

A candidate is tensor, pipeline and context parallel sizes (the rest data parallel), sequence parallelism with tp,
for a mixture-of-experts model an expert-parallel size carved from the data-parallel ranks, a ZeRO stage, an activation-checkpointing mode and the micro-batches per step that keep the global batch. Its
memory is the planner's (:func:`~lightning_llm.strategies.zero_auto.model_footprint` under the candidate's tp,
then :func:`~lightning_llm.planning.zero.estimate_options`); its step time is
:func:`~lightning_llm.planning.step_time.step_time` of the work one rank does
(:func:`~lightning_llm.modeling.op_work.forward_work`). The model is measured once per tensor-parallel layout and
micro-batch size, on fake tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
from torch import nn

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.experts import expert_count
from lightning_llm.modeling.op_work import forward_work
from lightning_llm.parallel.tp.model_plan import planned_shares
from lightning_llm.planning.memory import ModelFootprint
from lightning_llm.planning.sizes import GiB
from lightning_llm.planning.step_time import Rates, StepLayout, StepTime, step_time
from lightning_llm.planning.work import ForwardWork
from lightning_llm.planning.zero import estimate_options
from lightning_llm.strategies.zero_auto import model_footprint

log = logging.getLogger(__name__)

ZERO_STAGES = (0, 2, 3)  # natively ZeRO 1 runs as 2
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One layout with its micro-batch size, per-rank memory (bytes), predicted step time, and whether it fits."""

    layout: StepLayout
    micro_batch_size: int
    memory: float
    time: StepTime
    fits: bool

    @property
    def ep(self) -> int:
        """The expert-parallel size."""
        return self.layout.ep

    @property
    def samples(self) -> int:
        """Sequences per optimizer step over the whole job."""
        return self.micro_batch_size * self.layout.micro_batches * self.layout.pipeline_steps * self.layout.dp

    @property
    def seconds_per_sample(self) -> float:
        """What candidates are ranked by: the step time over the sequences the step trains."""
        return self.time.total / self.samples

    def line(self) -> str:
        """``tp= pp= cp= zero= ac= micro_batches=`` with the predicted memory and time."""
        lay = self.layout
        sp = " sp" if lay.sequence_parallel else ""
        return (
            f"tp={lay.tp}{sp} pp={lay.pp} cp={lay.cp} ep={self.ep} dp={lay.dp} zero={lay.zero_stage} "
            f"ac={lay.activation_checkpointing} micro_batches={lay.micro_batches} (micro-batch "
            f"{self.micro_batch_size}): {_size(self.memory)}, {self.time.total * 1e3:.1f} ms/step"
        )


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _heads(module: nn.Module) -> list[int]:
    config = getattr(module, "config", None)
    names = ("n_heads", "n_kv_heads", "num_attention_heads", "num_key_value_heads")
    return [h for h in (getattr(config, name, None) for name in names) if isinstance(h, int)]


def _expert_parallel_sizes(counts: set[int], dp: int, tp: int, cp: int, ep: int | None) -> list[int]:
    """``[ep]`` when given (dividing ``dp``, without cp), else for experts ``counts`` without tp or cp every size
    dividing ``dp`` and each count, else ``[1]``."""
    if ep is not None:
        return [ep] if dp % ep == 0 and (ep == 1 or cp == 1) else []
    if not counts or tp * cp > 1:
        return [1]
    return [d for d in _divisors(dp) if all(c % d == 0 for c in counts)]


def layouts(
    module: nn.Module,
    *,
    world_size: int,
    seq_len: int,
    global_batch: int | None = None,
    per_replica_batch: int | None = None,
    ep: int | None = None,
    accumulate: int = 1,
) -> Iterator[tuple[StepLayout, int]]:
    """(layout, micro-batch size) of every candidate: tp divides the heads, pp is at most the blocks (with at least pp
    micro-batches), cp splits the sequence into ``2 cp`` equal chunks, and the expert-parallel size (``ep`` when
    given, else searched for an MoE model: dividing the data-parallel size and every layer's experts, without tp or
    cp, with no selective checkpointing, as the strategy runs it) divides the data-parallel size.

    Either the ``global_batch`` is kept (each data-parallel rank's share split into micro-batches, by accumulation or
    the pipeline) or each data-parallel rank trains ``per_replica_batch`` sequences per step (a Trainer's dataloader
    batch: the pipeline's micro-batches split it, the global batch grows with the data-parallel size), ``accumulate``
    such batches per optimizer step (the Trainer's ``accumulate_grad_batches``)."""
    if (global_batch is None) == (per_replica_batch is None):
        raise ValueError("layouts() takes one of global_batch and per_replica_batch")
    blocks = len(find_blocks(module).blocks)
    experts = {c for c in (expert_count(m) for m in module.modules()) if c is not None}
    for tp in (d for d in _divisors(world_size) if all(h % d == 0 for h in _heads(module))):
        for pp in (d for d in _divisors(world_size // tp) if d <= blocks):
            for cp in (d for d in _divisors(world_size // (tp * pp)) if seq_len % (2 * d) == 0):
                dp = world_size // (tp * pp * cp)
                if global_batch is not None and global_batch % dp:
                    continue
                replica = global_batch // dp if global_batch is not None else per_replica_batch
                counts = _divisors(replica) if global_batch is not None or pp > 1 else [accumulate]
                runs = accumulate if global_batch is None and pp > 1 else 1  # schedule runs per optimizer step
                for expert_parallel in _expert_parallel_sizes(experts, dp, tp, cp, ep):
                    for micro_batches in (m for m in counts if m >= pp):
                        size = replica // micro_batches if pp > 1 or global_batch is not None else replica
                        for layout in _variants(world_size, (tp, pp, cp, expert_parallel), micro_batches, runs):
                            yield layout, size


def _variants(world_size: int, sizes: tuple, micro_batches: int, runs: int) -> Iterator[StepLayout]:
    """The sequence-parallel, ZeRO and checkpointing choices of one parallel shape ``(tp, pp, cp, ep)`` (no
    selective checkpointing with expert parallelism, which the strategy refuses)."""
    tp, pp, cp, ep = sizes
    dp = world_size // (tp * pp * cp)
    for sp in (False, True) if tp > 1 else (False,):
        for zero in ZERO_STAGES if dp * cp > 1 else (0,):
            for ac in CHECKPOINTING if ep == 1 else ("none", "full"):
                yield StepLayout(world_size, tp, pp, cp, zero, ac, micro_batches, sp, ep=ep, pipeline_steps=runs)


class _Measured:
    """The model's footprint and one rank's work per (tp, sequence parallel, cp, micro-batch), measured once."""

    def __init__(self, module: nn.Module, seq_len: int, precision: str, cp_method: str, documents: bool) -> None:
        self.module, self.seq_len, self.precision, self.cp_method = module, seq_len, precision, cp_method
        self.documents = documents
        self.tensors = sum(1 for _ in module.parameters())
        self._cache: dict[tuple, tuple[ModelFootprint, ForwardWork]] = {}

    def __call__(self, layout: StepLayout, micro_batch_size: int) -> tuple[ModelFootprint, ForwardWork]:
        tp, sp = layout.tp, layout.sequence_parallel
        key = (tp, sp, layout.cp, micro_batch_size)
        if key not in self._cache:
            footprint = model_footprint(
                self.module,
                micro_batch_size=micro_batch_size,
                seq_len=self.seq_len,
                precision=self.precision,
                tp=tp,
                sequence_parallel=sp,
                cp=layout.cp,
                context_parallel_method=self.cp_method,
                documents=self.documents,
            )
            shares = planned_shares(self.module, tp=tp, sequence_parallel=sp) if tp > 1 else None
            batch = torch.zeros(micro_batch_size, self.seq_len + 1, dtype=torch.long)
            step = lambda: self.module.training_step(batch, 0)  # noqa: E731
            work = forward_work(self.module, step, shares=shares, device=torch.device("cpu"))
            self._cache[key] = (footprint, work)
        return self._cache[key]


def rank_candidates(
    module: nn.Module,
    *,
    world_size: int,
    seq_len: int,
    device_memory: int,
    rates: Rates,
    global_batch: int | None = None,
    per_replica_batch: int | None = None,
    precision: str = "32-true",
    margin: float = 0.1,
    ep: int | None = None,
    accumulate: int = 1,
    context_parallel_method: str = "ring",
    documents: bool = False,
) -> list[Candidate]:
    """Every candidate of :func:`layouts`, fitting ones first, each group fastest first: the least predicted time per
    trained sequence (on a tie, the lower ZeRO stage, then the fewer model-parallel ranks, the less checkpointing,
    the fewer micro-batches). A tensor-parallel layout the model's plan refuses (a refusal of :func:`planned_shares`)
    is left out, with its reason in the log. ``ep``: the expert-parallel size when given (it needs a data-parallel
    size that divides by it), else searched for an MoE model. ``accumulate``: with ``per_replica_batch``, the
    Trainer's ``accumulate_grad_batches``. ``context_parallel_method``: the strategy's (what CP layouts' attention
    holds, :func:`~lightning_llm.strategies.zero_auto.model_footprint`); ``documents``: whether batches carry packed
    documents' ids (what it holds then). Example::

        ranked = rank_candidates(module, world_size=8, seq_len=4096, global_batch=8, device_memory=80 * 2**30,
                                 rates=rates)
        ranked[0].line()
    """
    measured = _Measured(module, seq_len, precision, context_parallel_method, documents)
    usable = device_memory * (1 - margin)
    candidates, refused = [], {}
    batches = {"global_batch": global_batch, "per_replica_batch": per_replica_batch, "accumulate": accumulate}
    for layout, micro_batch_size in layouts(module, world_size=world_size, seq_len=seq_len, ep=ep, **batches):
        key = (layout.tp, layout.sequence_parallel, layout.cp)
        if key in refused:
            continue
        try:
            footprint, work = measured(layout, micro_batch_size)
        except ValueError as error:  # a tensor-parallel plan (or CP layout) the model refuses: not a candidate
            refused[key] = error
            log.info("layout='auto': tp=%d cp=%d is not a candidate: %s", layout.tp, layout.cp, error)
            continue
        memory, seconds = _priced(layout, footprint, work, rates, world_size, precision, measured.tensors)
        candidates.append(Candidate(layout, micro_batch_size, memory, seconds, memory <= usable))
    # On a tie (communication hidden behind compute), less communication and fewer model-parallel splits first.
    order = {ac: i for i, ac in enumerate(CHECKPOINTING)}
    return sorted(
        candidates,
        key=lambda c: (
            not c.fits,
            round(c.seconds_per_sample, 12),
            c.layout.zero_stage,
            c.layout.tp * c.layout.pp * c.layout.cp,
            c.ep,
            order[c.layout.activation_checkpointing],
            c.layout.micro_batches,
        ),
    )


def _priced(
    layout: StepLayout,
    footprint: ModelFootprint,
    work: ForwardWork,
    rates: Rates,
    world_size: int,
    precision: str,
    tensors: int,
) -> tuple[float, StepTime]:
    """A candidate's planned bytes per rank and predicted step time (``tensors``: the model's parameter tensors)."""
    rows = estimate_options(
        footprint.num_params,
        footprint.largest_block,
        footprint.activations_for(layout.activation_checkpointing),
        outside_blocks=footprint.outside_blocks,
        world_size=world_size,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        precision=precision,
        allow_offload=False,
        optimizer_states=footprint.optimizer_states,
        activations_tp=footprint.activations_tp,
        ep=layout.ep,
        expert_params=footprint.expert_params,
    )
    memory = next(r for r in rows if r.zero_stage == layout.zero_stage).total
    held = footprint.num_params - footprint.expert_params * (1 - 1 / layout.ep)  # experts split over ep ranks
    seconds = step_time(
        work,
        layout,
        rates,
        rank_params=held / (layout.tp * layout.pp),
        rank_tensors=tensors / layout.pp,
        gather_bytes=2 if "16" in precision else 4,
        rank_expert_params=footprint.expert_params / layout.ep / (layout.tp * layout.pp) if layout.ep > 1 else 0.0,
    )
    return memory, seconds


def report_lines(ranked: list[Candidate], shown: int = 10) -> list[str]:
    """The fastest ``shown`` fitting candidates, then ``Chosen:`` and ``Runner-up:`` (the best other parallel layout,
    with how much slower it is predicted and the part of the step that differs most); ``Nothing fits`` where none
    does."""
    fitting = [c for c in ranked if c.fits]
    lines = [f"  {c.line()}" for c in fitting[:shown]]
    if not fitting:
        smallest = min(ranked, key=lambda c: c.memory)
        return [*lines, f"Nothing fits; the smallest is {smallest.line()}"]
    chosen = fitting[0]
    lines.append(f"Chosen: {chosen.line()}")
    shape = lambda c: (c.layout.tp, c.layout.sequence_parallel, c.layout.pp, c.layout.cp, c.ep)  # noqa: E731
    runner_up = next((c for c in fitting if shape(c) != shape(chosen)), None)
    if runner_up is not None:
        lines.append(f"Runner-up: {runner_up.line()}; {_why(runner_up, chosen)}")
    return lines


def _why(runner_up: Candidate, chosen: Candidate) -> str:
    """How much slower ``runner_up`` is predicted per sequence, and the part of the step time that differs most."""
    parts = {f.name: getattr(runner_up.time, f.name) - getattr(chosen.time, f.name) for f in fields(chosen.time)}
    name = max(parts, key=lambda k: abs(parts[k]))
    more = "more" if parts[name] > 0 else "less"
    slower = runner_up.seconds_per_sample / chosen.seconds_per_sample - 1
    return f"{slower:+.1%} predicted: {abs(parts[name]) * 1e3:.1f} ms {more} {name.replace('_', ' ')}"
