"""FP8 Linear layers under tensor parallelism: torchao's float8 TP styles for the layers the plan splits.

The fp8 swap (:mod:`lightning_llm.parallel.float8`) runs before TP, as in torchtitan. Under TP only
the layers whose style is :data:`FP8_TP_STYLES` (``colwise``, ``rowwise``: the attention and MLP
projections of a Llama-like block) stay in fp8; every other Linear of the blocks (fused projections,
experts, layers kept whole on every rank, layers the plan does not name) stays in high precision,
because those styles do their own input/output handling that torchao's casts were never composed with.
:func:`fp8_tp_exclusions` names them before the swap so they are never converted.

For the ``tensorwise`` recipe the split layers get torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` (what torchtitan's ``enable_float8_tensorwise_tp`` applies): the input is
cast to fp8 before it is gathered (sequence parallelism all-gathers fp8 bytes) and the output's
gradient is cast in the backward. Every tensorwise scale is the amax of the whole DTensor (a max over
the tp group), so each cast is the one a single process makes on the unsplit tensor. Over gloo, which
cannot all-gather float8 tensors, sequence parallelism gets torch's plain styles: the gathers stay in
high precision and ``Float8Linear`` casts the gathered DTensors itself, with the same scales.

The ``rowwise`` recipe is refused under TP (torchtitan runs it with the plain styles): its scales are
per row, and the splits divide rows between ranks, so the casts are no longer one process's.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_llm._compat.torch_distributed import apply_parallel_style
from lightning_llm.parallel.tp.style_kinds import matches

FP8_TP_STYLES = ("colwise", "rowwise")
FP8_TP_RECIPE = "tensorwise"
# Why the rowwise recipe is refused under TP, for the errors (measured by tests/strategies/test_fp8_tensor_parallel.py).
ROWWISE_REFUSAL = (
    "a rowwise scale is the amax of a whole row, and the splits divide the rows of a row-split layer's input and "
    "weight and of a column-split layer's output gradient between the tp ranks, so each rank scales its own part: "
    "2.4e-2 from one process after 5 steps, where tensorwise matches within 1e-6"
)


def _tensorwise(module: nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity, ScalingType

    casts = (module.config.cast_config_input, module.config.cast_config_weight, module.config.cast_config_grad_output)
    return all(
        c.scaling_granularity is ScalingGranularity.TENSORWISE and c.scaling_type is ScalingType.DYNAMIC for c in casts
    )


def style_of(name: str, plan: dict[str, str]) -> str | None:
    """The style ``plan`` gives module ``name`` as :func:`.apply.apply_tensor_parallel` applies it: the last
    matching pattern's, where "replicate" (which applies nothing) only counts when no other pattern matches."""
    styles = [style for pattern, style in plan.items() if matches(name, pattern)]
    applied = [style for style in styles if style != "replicate"]
    return (applied or styles or [None])[-1]


def fp8_tp_exclusions(module: nn.Module, plan: dict[str, str], blocks_name: str) -> list[str]:
    """Names of the blocks' Linear layers that must stay out of fp8 under ``plan`` (their style is not in
    :data:`FP8_TP_STYLES`), to be added to the fp8 swap's exclusions."""
    prefix = blocks_name + "."
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear) and name.startswith(prefix) and style_of(name, plan) not in FP8_TP_STYLES
    ]


def float8_parallel_style(style: str, sequence_parallel: bool, module: nn.Module) -> ParallelStyle | None:
    """The ParallelStyle for a ``Float8Linear`` ``module`` that the plan gives ``style`` (``None``: "replicate")."""
    if style == "replicate":
        return None
    if style not in FP8_TP_STYLES:
        raise ValueError(
            f"Tensor-parallel style {style!r} cannot split an fp8 layer ({type(module).__name__}); fp8 under tensor "
            f"parallelism supports {FP8_TP_STYLES}. Add the layer to fp8_exclude or give it one of those styles."
        )
    if not _tensorwise(module):
        raise ValueError(
            f"fp8 layer {type(module).__name__} does not use the 'tensorwise' recipe; under tensor parallelism only "
            f"{FP8_TP_RECIPE!r} is supported ({ROWWISE_REFUSAL})."
        )
    return Float8Split(style, sequence_parallel)


class Float8Split(ParallelStyle):
    """Split a ``Float8Linear`` by column (``"colwise"``) or row (``"rowwise"``), choosing the styles on the mesh.

    Layouts are those of the high-precision styles in :func:`.styles.parallel_style`: under sequence
    parallelism a column split reads, and a row split writes, this rank's sequence shard; a row split
    returns a DTensor (the caller wraps it when the model needs a local tensor). torchao's float8 styles
    need a tensorwise recipe and, under sequence parallelism, a backend that can all-gather float8
    tensors (NCCL can, gloo cannot: they gather the fp8 input forward and the fp8 output gradient
    backward). Over gloo torch's plain styles gather in high precision and ``Float8Linear`` casts the
    gathered DTensor; the casts are the same (the amax of a whole tensor), only the bytes sent differ.
    """

    def __init__(self, style: str, sequence_parallel: bool) -> None:
        super().__init__()
        self.style, self.sequence_parallel = style, sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sharded_seq = Shard(1) if self.sequence_parallel else Replicate()
        if not self.sequence_parallel or fp8_all_gather(device_mesh):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            colwise, rowwise = Float8ColwiseParallel, Float8RowwiseParallel
        else:
            colwise, rowwise = ColwiseParallel, RowwiseParallel
        if self.style == "colwise":
            split = colwise(input_layouts=sharded_seq)
        else:
            split = rowwise(output_layouts=sharded_seq, use_local_output=False)
        split.src_data_rank = self.src_data_rank
        return apply_parallel_style(split, module, device_mesh)


def fp8_all_gather(device_mesh: DeviceMesh) -> bool:
    """Whether the tp group's backend can all-gather float8 tensors (NCCL can; gloo answers "Invalid scalar type")."""
    return dist.get_backend(device_mesh.get_group()) != "gloo"
