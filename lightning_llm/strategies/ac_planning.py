"""Activation checkpointing for LLMParallelStrategy: the per-block policies, planned before training.

For "auto" one forward of the whole model on fake tensors measures what each block keeps, then
:func:`~lightning_llm.planning.activation_budget.plan_for_budget` picks the fewest blocks to
checkpoint. The result is a function that checkpoints the blocks a rank holds (its pipeline stages'),
called by :func:`~lightning_llm.parallel.parallelize.parallelize` after TP and before FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_llm.modeling.activations import measure_activations
from lightning_llm.modeling.log_redirect import redirected_log
from lightning_llm.parallel.activation_checkpointing import ACOptions, apply_activation_checkpointing, block_policies
from lightning_llm.parallel.devices import total_device_memory
from lightning_llm.parallel.kv_cache import disable_kv_cache
from lightning_llm.parallel.pipeline.stages import split_microbatches
from lightning_llm.planning.activation_budget import plan_for_budget, resolve_budget
from lightning_llm.planning.device_memory import device_memory_bytes
from lightning_llm.strategies.zero_auto import example_batch


def plan_checkpointing(
    trainer: L.Trainer,
    module: nn.Module,
    blocks: nn.ModuleList,
    *,
    mode: str,
    options: ACOptions,
    tp: int,
    sequence_parallel: bool,
    num_microbatches: int | None,
    device: torch.device,
) -> tuple[list[str], Callable[..., None] | None]:
    """(policy per block, the function that checkpoints a rank's blocks) for ``mode``; ``(["none"...], None)`` if off."""
    if mode == "none":
        return ["none"] * len(blocks), None
    disable_kv_cache(module)  # before "auto" measures: a cache would grow in the measuring forward too
    auto = None
    if mode == "auto":
        auto = _auto_policies(
            trainer,
            module,
            list(blocks),
            options=options,
            tp=tp,
            sequence_parallel=sequence_parallel,
            num_microbatches=num_microbatches,
            device=device,
        )
    policies = block_policies(mode, list(range(len(blocks))), options.selective, options.every_n_layers, auto)
    index_of = {id(block): i for i, block in enumerate(blocks)}

    def apply(owned_blocks: list[nn.Module], entries: dict[int, list[nn.Module]] | None = None) -> None:
        indices = [index_of[id(b)] for b in owned_blocks]
        apply_activation_checkpointing(
            owned_blocks,
            mode=mode,
            selective=options.selective,
            every_n_layers=options.every_n_layers,
            recompute_every_other_matmul=options.recompute_every_other_matmul,
            auto_policies=[auto[i] for i in indices] if auto is not None else None,
            block_indices=indices,
            entries=entries,
        )

    return policies, apply


def _auto_policies(trainer, module, blocks, *, options, tp, sequence_parallel, num_microbatches, device) -> list[str]:
    batch = example_batch(trainer, device)
    if num_microbatches:
        batch = split_microbatches(batch, num_microbatches)[0]
    with redirected_log(module):
        # The module may be on the meta device (built there by configure_model): faked where the batch is.
        sizes = measure_activations(module, blocks, lambda: module.training_step(batch, 0), device=device)
    # Per rank: what a block keeps is split over tp (heads, MLP width); its input only under SP.
    saved = [s.saved // tp for s in sizes]
    inputs = [s.input // (tp if sequence_parallel else 1) for s in sizes]
    memory = options.device_memory
    budget = resolve_budget(options.budget, device_memory_bytes(memory) if memory else total_device_memory(device))
    policies, predicted = plan_for_budget(saved, inputs, budget)
    rank_zero_info(
        f"Activation checkpointing 'auto': budget {budget / 2**20:.1f} MiB, measured {sum(saved) / 2**20:.1f} MiB "
        f"without checkpointing; checkpointing {policies.count('full')} of {len(policies)} blocks -> "
        f"{predicted / 2**20:.1f} MiB"
    )
    return policies
