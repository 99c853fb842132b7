"""Our tensor-parallel style names as ``torch.distributed.tensor.parallel`` styles.

Every style is torch's own ``ColwiseParallel``/``RowwiseParallel``/``SequenceParallel`` with the
input/output layouts the position in the model needs, except :class:`ReplicateGradSum`, a small
``ParallelStyle`` (built with torch's ``distribute_module``) for a module kept whole on every rank
but applied to each rank's own heads, the fused-projection and ``Conv1D`` styles of :mod:`.tp_fused`,
and the expert split of :mod:`.tp_experts`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_llm.parallel.tp.experts import ExpertsParallel
from lightning_llm.parallel.tp.fused import (
    FUSED_PREFIX,
    Conv1DColwise,
    Conv1DRowwise,
    FusedColwise,
    fused_sizes,
    is_conv1d,
    projection_dims,
)


class ReplicateGradSum(ParallelStyle):
    """Keep the module's parameters whole on every rank and sum their gradients over the tp group.

    For a module inside the head-sharded region of a block (between a column-split and a row-split
    layer), e.g. Qwen3's per-head ``q_norm``: each rank applies the same weight to its own heads, so
    each rank's weight gradient is the contribution of its heads only, and the true gradient is their
    **sum** (not the mean: the loss is one function of all heads; every head's term appears once).
    The parameters become ``Replicate`` DTensors and the module input the local rows of a ``Shard(0)``
    DTensor: to DTensor the local tensors are disjoint pieces of one computation, so the weight
    gradient comes out ``Partial`` and torch all-reduces (sums) it into the ``Replicate`` gradient.
    ``Shard(0)`` (rows) is a valid description for any per-row module (a norm over the last dim); it
    is torch's own bookkeeping, so FSDP2 on top sees ordinary (dp, tp) DTensor parameters.

    Example::

        parallelize_module(model, tp_mesh, {"layers.*.self_attn.q_norm": ReplicateGradSum()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._local_rows, output_fn=self._to_local)

    @staticmethod
    def _local_rows(module, inputs, device_mesh):
        return tuple(
            DTensor.from_local(x, device_mesh, [Shard(0)], run_check=False) if _plain_tensor(x) else x for x in inputs
        )

    @staticmethod
    def _to_local(module, outputs, device_mesh):
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        if isinstance(outputs, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
        return outputs


def _plain_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def parallel_style(style: str, sequence_parallel: bool, module: nn.Module | None = None) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` for one of our style names applied to ``module`` (``None``: leave it as it is).

    ``module`` matters for Hugging Face ``Conv1D`` layers (weights stored transposed) and fused projections.
    """
    sharded_seq = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel
    conv1d = module is not None and is_conv1d(module)
    if style.startswith(FUSED_PREFIX):
        return FusedColwise(fused_sizes(style, projection_dims(module)[1]), input_layouts=sharded_seq)
    if style == "colwise":
        return Conv1DColwise(input_layouts=sharded_seq) if conv1d else ColwiseParallel(input_layouts=sharded_seq)
    if style == "rowwise":
        if conv1d:
            return Conv1DRowwise(output_layouts=sharded_seq, use_local_output=local)
        return RowwiseParallel(output_layouts=sharded_seq, use_local_output=local)
    if style == "colwise_gather":
        if conv1d:
            return Conv1DColwise(input_layouts=sharded_seq, output_layouts=Replicate())
        return ColwiseParallel(input_layouts=sharded_seq, output_layouts=Replicate())
    if style == "rowwise_split_input":  # input replicated (full width), each rank multiplies its columns
        if conv1d:
            return Conv1DRowwise(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq, use_local_output=local)
    if style == "sequence_parallel":
        return SequenceParallel() if sequence_parallel else None
    if style == "replicate_grad_sum":
        return ReplicateGradSum()
    if style == "experts":
        return ExpertsParallel()
    if style == "gather_sequence":  # a module that needs the whole sequence inside a sequence-parallel model
        if not sequence_parallel:
            return None
        return PrepareModuleInputOutput(
            input_layouts=Shard(1),
            desired_input_layouts=Replicate(),
            use_local_input=True,
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
            use_local_output=False,
        )
    return None  # "replicate"
