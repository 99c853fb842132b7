"""Choosing a ZeRO stage and offload: the least communication that fits the device, or a refusal that says what would."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from lightning_llm.planning.memory import MemoryEstimate, ModelFootprint, fsdp2_copies, model_state_bytes
from lightning_llm.planning.sizes import GiB, format_size
from lightning_llm.planning.sizes import parse_size as parse_size

# Options from least to most communication (and host traffic).
# FSDP2's only offload (CPUOffloadPolicy) moves parameters, gradients and optimizer state together.
NATIVE_OPTIONS = [(0, "none"), (2, "none"), (3, "none"), (3, "optimizer+params")]
DEEPSPEED_OPTIONS = [(1, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer"), (3, "optimizer+params")]


class MemoryPlanError(ValueError):
    """Nothing fits; the message holds the table and the changes that would fit."""


@dataclass
class ZeroDecision:
    """The chosen stage and offload, every option's estimate, and the rendered table."""

    stage: int
    offload: str
    rows: list[MemoryEstimate] = field(default_factory=list)
    table: str = ""


def estimate_options(
    num_params: int,
    largest_block: int,
    activations: float,
    *,
    outside_blocks: int = 0,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    dp_replicate: int = 1,
    cp: int = 1,
    precision: str = "32-true",
    backend: str = "native",
    allow_offload: bool = True,
    usable: float | None = None,
    whole_grads: bool = False,
    optimizer_states: float = 2.0,
    ep: int = 1,
    expert_params: float = 0.0,
    activations_tp: int = 1,
) -> list[MemoryEstimate]:
    """Per-rank estimates of every option, ``fits`` set against ``usable`` bytes.

    ``whole_grads``: gradients accumulate unsharded (see :func:`~lightning_llm.planning.memory.model_state_bytes`).
    ``cp``: context-parallel ranks split every sequence, so each holds ``1/cp`` of the activations, and FSDP shards
    over the data-parallel and context-parallel ranks together (torchtitan's ``dp_shard_cp``).
    ``expert_params`` of ``num_params`` are MoE experts: with ``ep > 1`` each rank holds ``1/ep`` of them whole, and
    ZeRO 1-3 shard those over the ``dp / ep`` ranks outside its expert group (so at ZeRO 3 the bytes equal the dense
    ones'; ZeRO 0 and 2 gain from ``ep``); a block's experts share of ``largest_block`` is taken as the model's.
    ``activations_tp``: the ``activations`` are one rank's share under that tensor-parallel size (measured from the
    dataflow, :mod:`lightning_llm.modeling.tp_shares`); for another ``tp`` (the refusal's hints) they are scaled.
    """
    dp = world_size // (tp * pp * cp)
    shard = max(dp // dp_replicate, 1) * cp
    share = _RankParameters.of(num_params, largest_block, outside_blocks, expert_params, shard=shard, tp=tp, pp=pp,
                               ep=ep, backend=backend)  # fmt: skip
    rows = []
    for stage, offload in NATIVE_OPTIONS if backend == "native" else DEEPSPEED_OPTIONS:
        if offload != "none" and not allow_offload:
            continue
        fsdp2 = backend == "native" and offload == "none" and dp * cp > 1
        states = _state_bytes(share, stage, offload, fsdp2=fsdp2, precision=precision, backend=backend,
                              whole_grads=whole_grads, optimizer_states=optimizer_states)  # fmt: skip
        # 1F1B keeps up to pp micro-batches in flight on the first stage, each a 1/pp slice of the model.
        row = MemoryEstimate(stage, offload, *states, activations * activations_tp / (tp * cp))
        row.fits = usable is not None and row.total <= usable
        rows.append(row)
    return rows


@dataclass(frozen=True)
class _RankParameters:
    """The parameters one rank's model state is counted from: its dense and expert parameters, each part's share of
    the largest block, the root unit (embeddings, head), and the ranks each part is sharded over at ZeRO 1-3."""

    dense: float
    dense_block: float
    dense_shard: int
    experts: float
    expert_block: float
    expert_shard: int
    root: float

    @classmethod
    def of(
        cls,
        num_params: float,
        largest_block: float,
        outside_blocks: float,
        expert_params: float,
        *,
        shard: int,
        tp: int,
        pp: int,
        ep: int,
        backend: str,
    ) -> _RankParameters:
        """This rank's share under ``tp`` x ``pp`` (and ``ep`` for the experts), sharded over ``shard`` ranks."""
        expert_fraction = expert_params / num_params if num_params else 0.0
        return cls(
            dense=(num_params - expert_params) / (tp * pp),
            dense_block=largest_block * (1 - expert_fraction) / tp,
            dense_shard=shard,
            # Expert parallelism: each rank holds 1/ep of the experts, sharded further over the dp/ep ranks outside
            # its group.
            experts=expert_params / (tp * pp) / ep,
            expert_block=largest_block * expert_fraction / tp / ep,
            expert_shard=max(shard // ep, 1),
            # Natively the root unit (embeddings, head) stays gathered through the step.
            root=outside_blocks / tp if backend == "native" else 0.0,
        )


def _state_bytes(
    share: _RankParameters, stage: int, offload: str, *, fsdp2: bool, precision: str, **settings
) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per rank at ZeRO ``stage``: the dense part, the experts, and with
    ``fsdp2`` the copies FSDP2 holds besides (see :func:`~lightning_llm.planning.memory.fsdp2_copies`).

    ``settings``: ``backend``, ``whole_grads`` and ``optimizer_states`` of
    :func:`~lightning_llm.planning.memory.model_state_bytes`.
    """
    common = dict(zero_stage=stage, precision=precision, offload=offload, **settings)
    params, grads, optimizer = model_state_bytes(
        share.dense,
        dp=share.dense_shard if stage else 1,
        largest_block_params=share.dense_block,
        root_params=share.root,
        **common,
    )
    if share.experts:
        expert_states = model_state_bytes(
            share.experts, dp=share.expert_shard if stage else 1, largest_block_params=share.expert_block, **common
        )
        params, grads, optimizer = (a + b for a, b in zip((params, grads, optimizer), expert_states))
    if fsdp2:
        parts = (
            (share.dense, share.dense_shard, share.dense_block),
            (share.experts, share.expert_shard, share.expert_block),
        )
        for count, group, block in parts:
            extra = fsdp2_copies(count, zero_stage=stage, shard=group, precision=precision, largest_block_params=block)
            params, grads = params + extra[0], grads + extra[1]
    return params, grads, optimizer


def render_table(rows: list[MemoryEstimate], usable: float | None, chosen: MemoryEstimate | None = None) -> str:
    """A terminal table (rich, plain text) of bytes per rank, in GiB (MiB for small models)."""
    unit, name = (GiB, "GiB") if max(r.total for r in rows) >= GiB else (2**20, "MiB")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column(f"option ({name} per rank)")
    for column in ("params", "grads", "optim", "activ.", "total"):
        table.add_column(column, justify="right")
    table.add_column("fits")
    for row in rows:
        mark = ("yes" if row.fits else "no") + ("  <- chosen" if row is chosen else "")
        values = (row.params, row.grads, row.optimizer, row.activations, row.total)
        table.add_row(row.label, *(f"{v / unit:.2f}" for v in values), mark)
    console = Console(file=io.StringIO(), width=120, color_system=None, highlight=False)
    console.print(table)
    text = console.file.getvalue().rstrip()
    if usable is not None:
        text += f"\nusable device memory per rank: {usable / unit:.2f} {name}"
    return text


def plan_zero_stage(
    footprint: ModelFootprint,
    *,
    device_memory: int,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    dp_replicate: int = 1,
    cp: int = 1,
    ep: int = 1,
    precision: str = "32-true",
    activation_checkpointing: str = "none",
    backend: str = "native",
    allow_offload: bool = True,
    margin: float = 0.1,
    whole_grads: bool = False,
) -> ZeroDecision:
    """The least-communication (stage, offload) whose per-rank memory fits ``device_memory * (1 - margin)``.

    Raises :class:`MemoryPlanError` with the table and the changes that would fit (more devices,
    tensor/pipeline parallelism, offload, checkpointing). ``footprint`` holds the measured numbers
    (:func:`lightning_llm.strategies.zero_auto.model_footprint` measures a model).

    Example::

        footprint = ModelFootprint(num_params=7e9, largest_block=2e8, outside_blocks=2.6e8,
                                   activations=30 * 2**30, full_activations=4 * 2**30)
        plan_zero_stage(footprint, device_memory=80 * 2**30, world_size=8).stage   # 3
    """
    activations = footprint.activations_for(activation_checkpointing)
    usable = device_memory * (1 - margin)
    settings = dict(
        world_size=world_size,
        tp=tp,
        pp=pp,
        dp_replicate=dp_replicate,
        cp=cp,
        precision=precision,
        backend=backend,
        outside_blocks=footprint.outside_blocks,
        whole_grads=whole_grads,
        optimizer_states=footprint.optimizer_states,
        ep=ep,
        expert_params=footprint.expert_params,
        activations_tp=footprint.activations_tp,
        allow_offload=allow_offload,
        usable=usable,
    )
    rows = estimate_options(footprint.num_params, footprint.largest_block, activations, **settings)
    chosen = next((row for row in rows if row.fits), None)
    table = render_table(rows, usable, chosen)
    if chosen is None:
        hints = _what_would_fit(footprint, activations, activation_checkpointing, settings)
        raise MemoryPlanError(
            f"No ZeRO stage{' or offload' if allow_offload else ''} fits {format_size(device_memory)} per device "
            f"(margin {margin:.0%}):\n{table}\nOptions that would fit: " + ("; ".join(hints) or "none found") + "."
        )
    return ZeroDecision(chosen.zero_stage, chosen.offload, rows, table)


def _what_would_fit(
    footprint: ModelFootprint, activations: float, activation_checkpointing: str, settings: dict[str, Any]
) -> list[str]:
    """The changes, each alone, under which some option fits: what the refusal suggests.

    ``settings``: the keyword arguments of :func:`estimate_options` that found nothing fitting.
    """

    def fits(**changes) -> bool:
        acts = changes.pop("activations", activations)
        rows = estimate_options(footprint.num_params, footprint.largest_block, acts, **{**settings, **changes})
        return any(r.fits for r in rows)

    world_size, hints = settings["world_size"], []
    if settings["whole_grads"] and fits(whole_grads=False):
        hints.append("accumulation_sync='every_micro_batch' (gradients stay sharded through accumulation)")
    factor = next((f for f in (2, 4, 8, 16, 32) if fits(world_size=world_size * f)), None)
    if factor is not None:
        hints.append(f"{world_size * factor} devices ({factor}x) with ZeRO 3")
    hints += _larger_degrees_that_fit(settings, fits)
    if not settings["allow_offload"] and fits(allow_offload=True):
        native = settings["backend"] == "native"
        hints.append("CPU offload (cpu_offload=True)" if native else "CPU offload (offload='auto' or 'optimizer')")
    if activation_checkpointing != "full" and fits(activations=footprint.full_activations):
        hints.append("activation_checkpointing='full'")
    return hints


def _larger_degrees_that_fit(settings: dict[str, Any], fits: Callable[..., bool]) -> list[str]:
    """For each of tensor, pipeline and context parallelism alone: the smallest larger degree (2, 4 or 8) that
    divides the devices and makes some option fit."""
    hints = []
    for key, name in (
        ("tp", "tensor_parallel_size"),
        ("pp", "pipeline_parallel_size"),
        ("cp", "context_parallel_size"),
    ):
        for degree in (2, 4, 8):
            group = math.prod({"tp": settings["tp"], "pp": settings["pp"], "cp": settings["cp"], key: degree}.values())
            if degree > settings[key] and settings["world_size"] % group == 0 and fits(**{key: degree}):
                hints.append(f"{name}={degree}")
                break
    return hints
