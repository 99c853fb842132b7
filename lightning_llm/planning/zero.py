"""Choosing a ZeRO stage and offload: the least communication that fits the device, or a refusal that says what would."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from rich import box
from rich.console import Console
from rich.table import Table

from lightning_llm.planning.memory import MemoryEstimate, ModelFootprint, fsdp2_copies, model_state_bytes

GiB = 2**30
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
) -> list[MemoryEstimate]:
    """Per-rank estimates of every option, ``fits`` set against ``usable`` bytes.

    ``whole_grads``: gradients accumulate unsharded (see :func:`~lightning_llm.planning.memory.model_state_bytes`).
    ``cp``: context-parallel ranks split every sequence, so each holds ``1/cp`` of the activations, and FSDP shards
    over the data-parallel and context-parallel ranks together (torchtitan's ``dp_shard_cp``).
    ``expert_params`` of ``num_params`` are MoE experts: with ``ep > 1`` each rank holds ``1/ep`` of them whole, and
    ZeRO 1-3 shard those over the ``dp / ep`` ranks outside its expert group (so at ZeRO 3 the bytes equal the dense
    ones'; ZeRO 0 and 2 gain from ``ep``); a block's experts share of ``largest_block`` is taken as the model's.
    """
    expert_fraction = expert_params / num_params if num_params else 0.0
    dp = world_size // (tp * pp * cp)
    shard = max(dp // dp_replicate, 1) * cp
    # Expert parallelism: each rank holds 1/ep of the experts, sharded further over the dp/ep ranks outside its group.
    experts = expert_params / (tp * pp)
    dense, dense_block = (num_params - expert_params) / (tp * pp), largest_block * (1 - expert_fraction) / tp
    expert_block = largest_block * expert_fraction / tp / ep
    # Natively the root unit (embeddings, head) stays gathered through the step.
    root = outside_blocks / tp if backend == "native" else 0.0
    rows = []
    for stage, offload in NATIVE_OPTIONS if backend == "native" else DEEPSPEED_OPTIONS:
        if offload != "none" and not allow_offload:
            continue
        common = dict(
            zero_stage=stage,
            precision=precision,
            backend=backend,
            offload=offload,
            whole_grads=whole_grads,
            optimizer_states=optimizer_states,
        )
        params, grads, optimizer = model_state_bytes(
            dense, dp=1 if stage == 0 else shard, largest_block_params=dense_block, root_params=root, **common
        )
        if experts:
            expert_states = model_state_bytes(
                experts / ep, dp=1 if stage == 0 else max(shard // ep, 1), largest_block_params=expert_block, **common
            )
            params, grads, optimizer = (a + b for a, b in zip((params, grads, optimizer), expert_states))
        if backend == "native" and offload == "none" and dp * cp > 1:  # FSDP2 applies (see fsdp2_copies)
            for count, group, block in ((dense, shard, dense_block), (experts / ep, max(shard // ep, 1), expert_block)):
                extra = fsdp2_copies(
                    count, zero_stage=stage, shard=group, precision=precision, largest_block_params=block
                )
                params, grads = params + extra[0], grads + extra[1]
        # 1F1B keeps up to pp micro-batches in flight on the first stage, each a 1/pp slice of the model.
        row = MemoryEstimate(stage, offload, params, grads, optimizer, activations / (tp * cp))
        row.fits = usable is not None and row.total <= usable
        rows.append(row)
    return rows


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
    common = dict(
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
    )
    rows = estimate_options(
        footprint.num_params, footprint.largest_block, activations, allow_offload=allow_offload, usable=usable, **common
    )
    chosen = next((row for row in rows if row.fits), None)
    table = render_table(rows, usable, chosen)
    if chosen is None:
        hints = _what_would_fit(footprint, activations, usable, allow_offload, activation_checkpointing, **common)
        raise MemoryPlanError(
            f"No ZeRO stage{' or offload' if allow_offload else ''} fits {_size(device_memory)} per device "
            f"(margin {margin:.0%}):\n{table}\nOptions that would fit: " + ("; ".join(hints) or "none found") + "."
        )
    return ZeroDecision(chosen.zero_stage, chosen.offload, rows, table)


def _what_would_fit(
    footprint: ModelFootprint,
    activations,
    usable,
    allow_offload,
    activation_checkpointing,
    *,
    world_size,
    tp,
    pp,
    dp_replicate,
    cp,
    precision,
    backend,
    outside_blocks,
    whole_grads,
    optimizer_states,
    ep,
    expert_params,
) -> list[str]:
    def fits(**changes) -> bool:
        settings = dict(
            world_size=world_size,
            tp=tp,
            pp=pp,
            dp_replicate=dp_replicate,
            cp=cp,
            precision=precision,
            backend=backend,
            allow_offload=allow_offload,
            usable=usable,
            outside_blocks=outside_blocks,
            whole_grads=whole_grads,
            optimizer_states=optimizer_states,
            ep=ep,
            expert_params=expert_params,
        )
        acts = changes.pop("activations", activations)
        settings.update(changes)
        return any(r.fits for r in estimate_options(footprint.num_params, footprint.largest_block, acts, **settings))

    hints = []
    if whole_grads and fits(whole_grads=False):
        hints.append("accumulation_sync='every_micro_batch' (gradients stay sharded through accumulation)")
    for factor in (2, 4, 8, 16, 32):
        if fits(world_size=world_size * factor):
            hints.append(f"{world_size * factor} devices ({factor}x) with ZeRO 3")
            break
    for new_tp in (2, 4, 8):
        if new_tp > tp and (world_size % (new_tp * pp * cp) == 0) and fits(tp=new_tp):
            hints.append(f"tensor_parallel_size={new_tp}")
            break
    for new_pp in (2, 4, 8):
        if new_pp > pp and (world_size % (tp * new_pp * cp) == 0) and fits(pp=new_pp):
            hints.append(f"pipeline_parallel_size={new_pp}")
            break
    for new_cp in (2, 4, 8):
        if new_cp > cp and (world_size % (tp * pp * new_cp) == 0) and fits(cp=new_cp):
            hints.append(f"context_parallel_size={new_cp}")
            break
    if not allow_offload and fits(allow_offload=True):
        hints.append(
            "CPU offload (cpu_offload=True)" if backend == "native" else "CPU offload (offload='auto' or 'optimizer')"
        )
    if activation_checkpointing != "full" and fits(activations=footprint.full_activations):
        hints.append("activation_checkpointing='full'")
    return hints


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f} GiB" if num_bytes >= GiB else f"{num_bytes / 2**20:.1f} MiB"


def parse_size(text: str | int | float) -> int:
    """Bytes from "80GB", "80GiB", "24G", "512MB" or a number of bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    units = {
        "": 1,
        "B": 1,
        "K": 2**10,
        "KB": 10**3,
        "KIB": 2**10,
        "M": 2**20,
        "MB": 10**6,
        "MIB": 2**20,
        "G": 2**30,
        "GB": 10**9,
        "GIB": 2**30,
        "T": 2**40,
        "TB": 10**12,
        "TIB": 2**40,
    }
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGTIB")
    unit = stripped[len(number) :]
    try:
        return int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise ValueError(f"Cannot read the size {text!r}; write it like '80GB', '80GiB' or '24G'.") from None
