"""Data parallelism as ZeRO stages, on FSDP2 (``fully_shard``) and its replicate-only sibling.

=====  ================================================  ===============================================
stage  torch mechanism                                   communication per step
=====  ================================================  ===============================================
0      ``replicate`` (DDP semantics on FSDP2's engine):   all-reduce of gradients (2Ψ)
       parameters, gradients and optimizer state whole
1      runs as stage 2 (see below)                       as stage 2
2      ``fully_shard(reshard_after_forward=False)``:      all-gather of parameters before forward,
       gradients and optimizer state sharded; the         reduce-scatter of gradients after backward (2Ψ)
       gathered parameters stay resident from forward
       through backward, then are freed
3      ``fully_shard(reshard_after_forward=True)``:       all-gather before forward and again before
       parameters also sharded outside their block's      backward, reduce-scatter of gradients (3Ψ)
       forward/backward
=====  ================================================  ===============================================

Stage 1 of the ZeRO paper (only optimizer state sharded, gradients all-reduced whole) has no
FSDP2 mode: FSDP2 always reduce-scatters gradients. Its communication volume equals stage 2's,
and stage 2 holds less memory, so ``zero_stage=1`` runs as stage 2 (LLMDeepSpeedStrategy offers
DeepSpeed's own stage 1). With ``dp_replicate > 1`` stages 2 and 3 become HSDP: sharded within
a ``dp_shard`` group, replicated (gradients all-reduced) across ``dp_replicate`` groups.

Each transformer block is its own FSDP2 unit (one all-gather/reduce-scatter per block, overlapped
with compute), then the root takes the remaining parameters (embeddings, final norm, head).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_llm._compat.torch_distributed import replicate_with_fsdp

log = logging.getLogger(__name__)

# The stages the native (FSDP2) path implements; "auto" is resolved to one of them before this point.
FSDP2_ZERO_STAGES = (0, 1, 2, 3)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a Lightning precision string.

    ``"bf16-mixed"`` keeps fp32 parameters and optimizer state, computes in bf16 and reduces
    gradients in fp32; ``"bf16-true"`` and ``"32-true"`` compute in the parameters' own dtype.
    """
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_data_parallel(
    roots: list[nn.Module],
    blocks: nn.ModuleList,
    *,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    shared: list[nn.Module] = (),
    entries: dict[int, list[nn.Module]] | None = None,
) -> None:
    """Make the model data parallel over ``dp_mesh`` as ZeRO ``zero_stage`` (in place).

    Every block becomes one unit, then each module of ``roots`` takes the parameters left
    (embeddings, final norm, head). ``entries``: block (by id) -> the modules it is entered through, for blocks the
    model does not call as a whole (:func:`~lightning_llm.modeling.blocks.entry_modules`): FSDP2 groups them into
    the block's one unit (its hooks are on those modules); ZeRO 0 replicates each. ``dp_mesh`` is 1-D for pure sharding/replication or 2-D
    ``(dp_replicate, dp_shard)`` for HSDP. ``shared``: modules several blocks call
    (:func:`~lightning_llm.modeling.tied.modules_shared_by_blocks`), each made a unit of its own first, so the
    blocks' units leave their parameters to it and they are sharded once.
    """
    if zero_stage not in FSDP2_ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r} is not one of {FSDP2_ZERO_STAGES}.")
    kwargs = dict(
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    if zero_stage == 0:
        # FSDP2's replicate() is DDP built on the fully_shard machinery: it composes with tensor-parallel
        # DTensor parameters and per-block units as fully_shard does, which the DistributedDataParallel
        # wrapper does not. It lives in a private module (lightning_llm._compat).
        units = [unit for block in blocks for unit in _entries(block, entries)]
        for module in [*shared, *units, *roots]:
            replicate_with_fsdp(module, mesh=dp_mesh, **kwargs)
    else:
        for module in shared:  # called once per block that holds it: gathered for each call, like a block
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero_stage == 3, **kwargs)
        for block in blocks:
            units = _entries(block, entries)
            fully_shard(
                units if len(units) > 1 else units[0], mesh=dp_mesh, reshard_after_forward=zero_stage == 3, **kwargs
            )
        for root in roots:
            fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, **kwargs)
    log.info(
        "Applied ZeRO stage %d (%s) over %d data-parallel ranks to %d blocks",
        zero_stage,
        "replicate" if zero_stage == 0 else "fully_shard",
        dp_mesh.size(),
        len(blocks),
    )


def _entries(block: nn.Module, entries: dict[int, list[nn.Module]] | None) -> list[nn.Module]:
    return (entries or {}).get(id(block), [block])


# How gradients are reduced on the micro-batches before the last one of an optimizer step.
ACCUMULATION_SYNC = ("auto", "every_micro_batch", "last_micro_batch")


def syncs_every_micro_batch(accumulation_sync: str, zero_stage: int) -> bool:
    """Whether accumulation steps reduce(-scatter) their gradients, for an option of :data:`ACCUMULATION_SYNC`.

    "auto" does where gradients are sharded (ZeRO 1-3): skipping the reduce-scatter would keep every rank's whole
    unsharded gradients alive until the last micro-batch, undoing what the stage was chosen for. At ZeRO 0 the
    gradients are whole on every rank anyway, so one all-reduce at the last micro-batch is the cheaper choice.
    """
    if accumulation_sync == "auto":
        return zero_stage >= 1
    return accumulation_sync == "every_micro_batch"


def holds_whole_gradients(accumulation_sync: str, accumulate: int, pipeline_micro_batches: int = 1) -> bool:
    """Whether every rank holds whole unsharded gradients between the micro-batches of a step: with
    ``"last_micro_batch"``, where a step has several (Lightning's ``accumulate`` or a pipeline's micro-batches)."""
    return accumulation_sync == "last_micro_batch" and (accumulate > 1 or pipeline_micro_batches > 1)


@contextmanager
def accumulation_sync(model: nn.Module, *, every_micro_batch: bool) -> Iterator[None]:
    """Gradient reduction of every FSDP2 unit of ``model`` for one accumulation (not last) micro-batch.

    ``every_micro_batch``: reduce-scatter as usual, so each rank accumulates only its gradient shard (torchtitan's
    behaviour); under HSDP the all-reduce across replicas waits for the last micro-batch. Otherwise no reduction at
    all (DDP's ``no_sync``): each rank accumulates whole gradients and the last micro-batch reduces the sum.
    """
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        if every_micro_batch:
            unit.set_requires_all_reduce(False, recurse=False)
        else:
            unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        resume_gradient_sync(units)


def resume_gradient_sync(units: list[FSDPModule]) -> None:
    """Let ``units`` reduce their gradients again (the next backward reduces what they accumulated)."""
    for unit in units:
        unit.set_requires_gradient_sync(True, recurse=False)
        unit.set_requires_all_reduce(True, recurse=False)
