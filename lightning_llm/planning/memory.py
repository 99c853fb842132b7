"""Per-rank memory of LLM training under each ZeRO stage, offload option and parallel layout.

Model states follow the ZeRO paper's accounting (Rajbhandari et al. 2020): with Ψ parameters,
mixed-precision AdamW keeps 2Ψ bytes of 16-bit parameters, 2Ψ of gradients and KΨ = 12Ψ of fp32
master weights and moments; ZeRO shards the optimizer state (stage 1), then gradients (2), then
parameters (3) over N_d data-parallel ranks. Tensor and pipeline parallelism divide all of them.
The activation bytes come in measured (:func:`lightning_llm.modeling.activations.activation_bytes`:
one forward on fake tensors, nothing allocated, so a 70B model plans on a laptop); this module is
arithmetic only.
"""

from __future__ import annotations

from dataclasses import dataclass

# (parameter, gradient, optimizer-state) bytes per parameter, and fp32 master bytes, per precision.
_BYTES = {
    "32-true": (4, 4, 8, 0),
    "bf16-mixed": (4, 4, 8, 0),  # native FSDP2: fp32 parameters, bf16 compute copies made on the fly
    "16-mixed": (4, 4, 8, 0),
    "bf16-true": (2, 2, 4, 0),
    # Lightning's fp8 precisions (TransformerEngine) keep 16-bit weights and optimizer state, as bf16-true; the fp8
    # copies are made per matmul. LLMParallelStrategy(fp8=True) runs under "bf16-mixed" and plans as such: its fp8
    # weights exist only while gathered, in place of the bf16 copies.
    "transformer-engine": (2, 2, 4, 0),
    "transformer-engine-float16": (2, 2, 4, 0),
}
_DEEPSPEED_BYTES = {  # DeepSpeed keeps 16-bit parameters and gradients plus fp32 master weights: K = 12
    "32-true": (4, 4, 8, 4),  # its fp32 master partition exists even when the model is fp32
    "bf16-mixed": (2, 2, 8, 4),
    "16-mixed": (2, 2, 8, 4),
    "bf16-true": (2, 2, 4, 0),
}
# With 16-bit parameters DeepSpeed also keeps an fp32 gradient partition for the optimizer step (the "18" of its own
# estimators, estimate_zero2/zero3_model_states_mem_needs: 2 fp16 grads + 4 fp32 grads + 4 fp32 params + 8 moments).
_DEEPSPEED_FP32_GRADS = {"bf16-mixed": 4, "16-mixed": 4}


@dataclass(frozen=True)
class ModelFootprint:
    """What memory planning needs to know of a model, measured once per model-parallel rank's view of it.

    Attributes:
        num_params: all parameters of the whole model.
        largest_block: parameters of its largest transformer block.
        outside_blocks: parameters outside the blocks (embeddings, final norm, head).
        activations: bytes autograd keeps for one micro-batch without checkpointing.
        full_activations: the same with every block fully checkpointed.
        selective_activations: the same with ``activation_checkpointing="selective"``'s policy; ``None`` when not
            measured (then planned at ``activations``, an upper bound).
        optimizer_states: the optimizer's state bytes per parameter byte (see :func:`model_state_bytes`).
        expert_params: of ``num_params``, those in MoE experts (divided by expert parallelism).
        activations_tp: the tensor-parallel size the activation bytes are one rank's share of (measured from the
            model's dataflow under its tensor-parallel plan); 1: the whole model's, divided by ``tp`` when planned.
    """

    num_params: float
    largest_block: float
    outside_blocks: float
    activations: float
    full_activations: float
    selective_activations: float | None = None
    optimizer_states: float = 2.0  # state bytes per parameter byte of the user's optimizer (AdamW: 2)
    expert_params: float = 0.0
    activations_tp: int = 1

    def activations_for(self, activation_checkpointing: str) -> float:
        """Bytes for one mode: "full", "selective" (when measured) or, for "none" and "auto", without checkpointing."""
        if activation_checkpointing == "full":
            return self.full_activations
        if activation_checkpointing == "selective" and self.selective_activations is not None:
            return self.selective_activations
        return self.activations


@dataclass
class MemoryEstimate:
    """Bytes per rank of one option; ``fits`` against the device memory less the safety margin."""

    zero_stage: int
    offload: str
    params: float
    grads: float
    optimizer: float
    activations: float
    fits: bool = False

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def label(self) -> str:
        return f"ZeRO {self.zero_stage}" + ("" if self.offload == "none" else f" + offload {self.offload}")


def model_state_bytes(
    num_params: float,
    *,
    zero_stage: int,
    dp: int,
    precision: str = "32-true",
    backend: str = "native",
    offload: str = "none",
    largest_block_params: float = 0.0,
    root_params: float = 0.0,
    whole_grads: bool = False,
    optimizer_states: float = 2.0,
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state incl. master weights) bytes per rank for ``num_params`` per model-parallel rank.

    Native stages follow :mod:`lightning_llm.parallel.data_parallel`: stage 1 runs as stage 2, whose
    gathered parameters stay resident from forward to backward; stage 3 holds its shard, one gathered
    block (``largest_block_params``) and, natively, the root unit (``root_params``: embeddings, head),
    which FSDP2 keeps gathered through the step. ``whole_grads``: gradient accumulation without a reduction on
    its micro-batches (``accumulation_sync="last_micro_batch"``) holds every gradient unsharded until the last one.
    ``optimizer_states``: the optimizer's state bytes per parameter byte (AdamW's 2, which the tables assume; SGD with
    momentum 1, AMSGrad 3; :mod:`lightning_llm.modeling.optimizer_state` measures the user's).
    """
    if backend == "deepspeed":
        return _deepspeed_state_bytes(
            num_params,
            zero_stage=zero_stage,
            dp=dp,
            precision=precision,
            offload=offload,
            largest=largest_block_params,
            optimizer_states=optimizer_states,
        )
    table = _BYTES
    if precision not in table:
        raise ValueError(f"precision={precision!r} is not planned for; use one of {sorted(table)}.")
    p_bytes, g_bytes, o_bytes, master = table[precision]
    o_bytes *= optimizer_states / 2
    optimizer = (o_bytes + master) * num_params
    if backend == "native" and zero_stage in (1, 2):
        params, grads, optimizer = p_bytes * num_params, g_bytes * num_params / dp, optimizer / dp
    elif zero_stage == 0:
        params, grads = p_bytes * num_params, g_bytes * num_params
    elif zero_stage == 1:
        params, grads, optimizer = p_bytes * num_params, g_bytes * num_params, optimizer / dp
    elif zero_stage == 2:
        params, grads, optimizer = p_bytes * num_params, g_bytes * num_params / dp, optimizer / dp
    else:
        params = p_bytes * ((num_params - root_params) / dp + root_params + largest_block_params)
        grads, optimizer = g_bytes * num_params / dp, optimizer / dp
    if whole_grads:
        grads = g_bytes * num_params
    if offload != "none":
        # FSDP2's CPUOffloadPolicy moves the sharded parameters, gradients and optimizer state to the host (it has no
        # optimizer-only mode): the device holds the root unit and the block in flight, gathered, and that block's
        # gradients until they are reduce-scattered to the host.
        params = p_bytes * (root_params + largest_block_params)
        grads, optimizer = g_bytes * largest_block_params, 0.0
    return params, grads, optimizer


# Bytes of the copy FSDP2 computes with (its MixedPrecisionPolicy's param_dtype): 16-bit under the mixed precisions.
_COMPUTE_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2}


def fsdp2_copies(
    num_params: float, *, zero_stage: int, shard: int, precision: str, largest_block_params: float
) -> tuple[float, float]:
    """(parameter bytes, gradient bytes) FSDP2 holds per rank beyond :func:`model_state_bytes`'s, with no offload.

    FSDP2 keeps each unit's sharded parameters while its unsharded ones are resident: ZeRO 0 (``replicate``, a
    shard group of one: two whole copies) and ZeRO 1-2 (unsharded from forward to the end of backward) hold
    the sharded storage besides; ZeRO 3 prefetches the next block's all-gather while one block computes, and a
    block's unsharded gradients wait in the reduce-scatter buffer. Unsharded copies are in the compute dtype (bf16
    under the mixed precisions: ZeRO 1-2's resident copy takes 2 bytes a parameter, not the 4 of the fp32 shards
    that :func:`model_state_bytes` counts it at). Measured with torch's ``FSDPMemTracker``
    (``tests/planning/test_planned_totals.py``). ``shard``: ranks the parameters are sharded over (1 at ZeRO 0, where
    the copy exists once the model is data parallel at all).
    """
    p_bytes, g_bytes = _BYTES.get(precision, _BYTES["32-true"])[:2]
    c_bytes = _COMPUTE_BYTES.get(precision, p_bytes)
    if zero_stage == 0:
        return c_bytes * num_params, 0.0
    if zero_stage in (1, 2):  # model_state_bytes counts the resident unsharded copy at the storage width
        return p_bytes * num_params / shard + (c_bytes - p_bytes) * num_params, 0.0
    return c_bytes * largest_block_params, g_bytes * largest_block_params


def _deepspeed_state_bytes(
    num_params: float,
    *,
    zero_stage: int,
    dp: int,
    precision: str,
    offload: str,
    largest: float,
    optimizer_states: float,
) -> tuple[float, float, float]:
    """:func:`model_state_bytes` as DeepSpeed allocates, following its own estimators (without their buffer factor).

    Stages 1-2 keep 16-bit parameters whole and shard fp16 gradients, fp32 gradients and the optimizer state; stage 3
    also shards the parameters, keeps no fp16 gradient partition beside the fp32 one, and gathers one block's 16-bit
    parameters (``largest``: the largest transformer block, where DeepSpeed's estimator counts 4 bytes per parameter
    of the largest leaf layer; a block holds several such layers).
    """
    if precision not in _DEEPSPEED_BYTES:
        raise ValueError(f"precision={precision!r} is not planned for; use one of {sorted(_DEEPSPEED_BYTES)}.")
    p_bytes, g_bytes, o_bytes, master = _DEEPSPEED_BYTES[precision]
    o_bytes *= optimizer_states / 2
    fp32_grads = _DEEPSPEED_FP32_GRADS.get(precision, 0)
    optimizer = (o_bytes + master) * num_params / (dp if zero_stage >= 1 else 1)
    if zero_stage == 0:
        params, grads = p_bytes * num_params, (g_bytes + fp32_grads) * num_params
    elif zero_stage == 1:
        params, grads = p_bytes * num_params, g_bytes * num_params + fp32_grads * num_params / dp
    elif zero_stage == 2:
        params, grads = p_bytes * num_params, (g_bytes + fp32_grads) * num_params / dp
    else:
        params = p_bytes * (num_params / dp + largest)
        grads = (fp32_grads or g_bytes) * num_params / dp
    if offload in ("optimizer", "optimizer+params"):  # the fp32 state and gradient partitions live on the host
        optimizer, grads = 0.0, 0.0
    if offload == "optimizer+params":
        params = p_bytes * largest
    return params, grads, optimizer
