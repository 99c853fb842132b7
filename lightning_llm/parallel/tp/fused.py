"""Column-split fused projections (one QKV or gate/up weight) and Hugging Face ``Conv1D`` layers.

A fused projection stores several outputs one after another: ``[all q | all k | all v]`` (litgpt,
GPT-2's ``c_attn``, Phi-3's ``qkv_proj``) or ``[gate | up]`` (Phi-3's ``gate_up_proj``), or ``[all q | k | v]`` with one key/value head shared by all
query heads (multi-query attention: GPTBigCode, Falcon-7B). A plain
column split would give rank 0 all of q and rank 1 all of k and v. :class:`FusedColwise` keeps the
weight in the model's own layout, split into contiguous rows like any ``colwise`` layer (so
checkpoints, initialization and pretrained loading see an ordinary ``Shard`` DTensor), and regroups
the *output* with one all-to-all over the tp group so that each rank ends up with ``[its q | its k |
its v]``: the model's own ``split``/``chunk`` of that output then gives each rank whole heads of its
own, and attention runs split across ranks. A part written ``*N`` (``fused_colwise:512,*64,*64``, the
shared k and v of multi-query attention) is sent whole to every rank instead: its rows stay stored
once (sharded like the rest), each rank computes with all of it, and the all-to-all's backward
(index_select of one column for several ranks) sums the ranks' gradients into it, which is
Megatron's "k/v replicated, gradients summed over tp" without a second copy. The alternative, permuting the stored rows per rank
(Megatron's way), would need a conversion at every boundary (checkpoints, optimizer state,
initialization, pretrained weights, a change of tp size on resume); the all-to-all moves
``out_features / tp`` activations per token and is exact by construction.

Layouts that are already contiguous per head or per KV group (GPT-NeoX's ``query_key_value``:
``[q0 k0 v0 | q1 k1 v1 | ...]``) need no regrouping: they are ordinary ``colwise`` layers.

``Conv1D`` (``transformers.pytorch_utils.Conv1D``) stores its weight as ``(in, out)``, the
transpose of ``nn.Linear``; torch's Colwise/RowwiseParallel accept only ``nn.Linear``, so
:class:`Conv1DColwise` and :class:`Conv1DRowwise` shard it with DTensor, the same layouts in and out.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_llm._compat.torch_distributed import all_to_all_single, apply_parallel_style
from lightning_llm.parallel.tp.heads import int_attribute
from lightning_llm.parallel.tp.style_kinds import FUSED_PREFIX as FUSED_PREFIX  # the fused styles' prefix, re-exported

QUERY_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_query_groups")


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: a Linear whose weight is stored ``(in_features, out_features)``."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and weight is not None and weight.ndim == 2


def projection_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of an ``nn.Linear`` or ``Conv1D``, else ``None``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return tuple(module.weight.shape)
    return None


def parse_fused(style: str) -> tuple[int, ...] | int | None:
    """``"fused_colwise:32,16,16"`` -> (32, 16, 16); ``"fused_colwise:2"`` -> 2 (equal parts); else None.

    A part may be written ``*N`` (whole on every rank, see :func:`shared_parts`); its size is N.
    """
    if not style.startswith(FUSED_PREFIX):
        return None
    try:
        parts = tuple(int(p.removeprefix("*")) for p in style[len(FUSED_PREFIX) :].split(","))
    except ValueError:
        parts = ()
    if not parts or any(p <= 0 for p in parts):
        raise ValueError(
            f"Tensor-parallel style {style!r} is malformed: write 'fused_colwise:N' (N equal parts, e.g. 2 for gate/up) "
            "or 'fused_colwise:Q,K,V' (the output sizes stored one after another, e.g. 'fused_colwise:4096,1024,1024'; "
            "'*N' for a part every rank uses whole, e.g. multi-query 'fused_colwise:4096,*128,*128')."
        )
    return parts[0] if len(parts) == 1 else parts


def shared_parts(style: str) -> tuple[bool, ...]:
    """Which parts of a ``fused_colwise:`` style every rank uses whole (written ``*N``), in order."""
    parts = parse_fused(style)
    if isinstance(parts, int):  # "fused_colwise:N": N equal parts, all split
        return (False,) * parts
    return tuple(p.startswith("*") for p in style[len(FUSED_PREFIX) :].split(","))


def fused_sizes(style: str, out_features: int) -> tuple[int, ...]:
    """The output sizes of each part for a ``fused_colwise:`` style on a layer with ``out_features`` outputs."""
    parts = parse_fused(style)
    if isinstance(parts, int):
        if out_features % parts:
            raise ValueError(f"{style!r}: {out_features} outputs do not split into {parts} equal parts.")
        return (out_features // parts,) * parts
    if sum(parts) != out_features:
        raise ValueError(f"{style!r}: the parts add up to {sum(parts)}, but the layer has {out_features} outputs.")
    return parts


def qkv_style(attention: nn.Module, out_features: int, where: str) -> str:
    """``fused_colwise:Q,K,V`` for a ``[all q | all k | all v]`` projection, sizes from ``attention``'s head counts."""
    owners = [attention, getattr(attention, "config", None)]
    query = int_attribute(owners, QUERY_ATTRS)
    kv = int_attribute(owners, KV_ATTRS) or query
    if query is None or out_features % (query + 2 * kv):
        raise ValueError(
            f"{where!r} ({out_features} outputs) looks like a fused q|k|v projection, but its head counts "
            f"(query {query}, key/value {kv}) do not account for its width. Give its layout in the plan: "
            f"tensor_parallel_plan={{'{where}': 'fused_colwise:Q,K,V'}} with the q, k and v output sizes."
        )
    head_dim = out_features // (query + 2 * kv)
    return f"{FUSED_PREFIX}{query * head_dim},{kv * head_dim},{kv * head_dim}"


def regroup_exchange(
    sizes: tuple[int, ...], tp: int, rank: int, shared: tuple[bool, ...] = ()
) -> tuple[list[int], list[int], list[int]]:
    """(local output columns in send order, input split sizes, output split sizes) of the regrouping all-to-all.

    Rank ``r`` holds the contiguous columns ``[r*N/tp, (r+1)*N/tp)``; rank ``s`` wants its ``1/tp`` of
    every part (all of a ``shared`` part), in part order. Received pieces arrive ordered by source rank,
    i.e. ascending columns, which is exactly ``s``'s wanted order, so only the send side reorders.
    """
    total = sum(sizes)
    width = total // tp
    shared = shared or (False,) * len(sizes)
    if len(shared) != len(sizes):
        raise ValueError(f"{len(shared)} shared flags for {len(sizes)} fused parts {sizes}.")

    def wanted(s: int) -> list[int]:
        columns, offset = [], 0
        for size, whole in zip(sizes, shared):
            part = size if whole else size // tp
            start = offset if whole else offset + s * part
            columns += range(start, start + part)
            offset += size
        return columns

    def held(r: int, columns: list[int]) -> list[int]:
        return [c for c in columns if r * width <= c < (r + 1) * width]

    send, input_splits = [], []
    for s in range(tp):
        mine = held(rank, wanted(s))
        send += [c - rank * width for c in mine]
        input_splits.append(len(mine))
    output_splits = [len(held(r, wanted(rank))) for r in range(tp)]
    return send, input_splits, output_splits


class FusedColwise(ParallelStyle):
    """Column-split a fused projection (``nn.Linear`` or ``Conv1D``) so each rank gets its share of every part.

    Arguments:
        sizes: output sizes of the parts stored one after another (e.g. q, k, v widths); each must divide by tp.
        input_layouts: placement of the module input (``Replicate()``, or ``Shard(1)`` under sequence parallelism).
        shared: per part, whether every rank gets it whole (multi-query k and v); default: none.

    Example::

        parallelize_module(model, tp_mesh, {"transformer.h.*.attn.c_attn": FusedColwise((768, 768, 768))})
    """

    def __init__(
        self, sizes: tuple[int, ...], input_layouts: Placement = Replicate(), shared: tuple[bool, ...] = ()
    ) -> None:
        super().__init__()
        self.sizes, self.input_layouts, self.shared = tuple(sizes), input_layouts, tuple(shared)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        bad = [s for s in self.sizes if s % tp]
        if bad:
            raise ValueError(f"Fused projection parts {self.sizes} are not all divisible by tensor_parallel_size={tp}.")
        colwise = (
            Conv1DColwise(self.input_layouts)
            if is_conv1d(module)
            else ColwiseParallel(input_layouts=self.input_layouts)
        )
        colwise.src_data_rank = self.src_data_rank
        apply_parallel_style(colwise, module, device_mesh)
        if len(self.sizes) > 1:
            send, input_splits, output_splits = regroup_exchange(
                self.sizes, tp, device_mesh.get_local_rank(), self.shared
            )
            module.register_forward_hook(Regroup(send, input_splits, output_splits, device_mesh))
        return module


class Regroup:
    """Forward hook: all-to-all a colwise layer's local output columns so each rank holds its share of every part."""

    def __init__(self, send: list[int], input_splits: list[int], output_splits: list[int], mesh: DeviceMesh) -> None:
        self.send, self.input_splits, self.output_splits, self.mesh = send, input_splits, output_splits, mesh
        self._index = None

    def __call__(self, module, args, output):
        if self._index is None or self._index.device != output.device:
            self._index = torch.tensor(self.send, dtype=torch.long, device=output.device)
        columns = output.index_select(-1, self._index).movedim(-1, 0).contiguous()
        # torch's functional collective carries autograd (the backward is the reverse all-to-all).
        received = all_to_all_single(columns, self.output_splits, self.input_splits, self.mesh)
        return received.movedim(0, -1)


class Conv1DParallel(ParallelStyle):
    """A ``Conv1D`` layer's parameters sharded by :attr:`PLACEMENTS`, its input brought to :attr:`COMPUTED_ON`.

    The common part of :class:`Conv1DColwise` and :class:`Conv1DRowwise`, which say where each parameter is split
    and which layout the layer computes on; the input arrives as ``input_layouts`` and the output leaves as
    ``output_layouts`` (a local tensor when ``use_local_output``).
    """

    PLACEMENTS: ClassVar[dict[str, Placement]]
    COMPUTED_ON: ClassVar[Placement]

    def __init__(self, input_layouts: Placement, output_layouts: Placement, use_local_output: bool) -> None:
        super().__init__()
        self.input_layouts, self.output_layouts, self.use_local_output = input_layouts, output_layouts, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_partition(self.PLACEMENTS, self.src_data_rank),
            input_fn=_inputs(self.input_layouts, self.COMPUTED_ON),
            output_fn=_outputs(self.output_layouts, self.use_local_output),
        )


class Conv1DColwise(Conv1DParallel):
    """ColwiseParallel for ``Conv1D``: weight ``Shard(1)`` (outputs), bias ``Shard(0)``; input gathered to Replicate."""

    PLACEMENTS: ClassVar[dict[str, Placement]] = {"weight": Shard(1), "bias": Shard(0)}
    COMPUTED_ON = Replicate()

    def __init__(
        self,
        input_layouts: Placement = Replicate(),
        output_layouts: Placement = Shard(-1),
        use_local_output: bool = True,
    ) -> None:
        super().__init__(input_layouts, output_layouts, use_local_output)


class Conv1DRowwise(Conv1DParallel):
    """RowwiseParallel for ``Conv1D``: weight ``Shard(0)`` (inputs), bias whole; output reduced to ``output_layouts``."""

    PLACEMENTS: ClassVar[dict[str, Placement]] = {"weight": Shard(0), "bias": Replicate()}
    COMPUTED_ON = Shard(-1)

    def __init__(
        self,
        input_layouts: Placement = Shard(-1),
        output_layouts: Placement = Replicate(),
        use_local_output: bool = True,
    ) -> None:
        super().__init__(input_layouts, output_layouts, use_local_output)


def _partition(placements: dict[str, Placement], src_data_rank: int | None):
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            dtensor = distribute_tensor(param, mesh, [placements[param_name]], src_data_rank=src_data_rank)
            module.register_parameter(param_name, nn.Parameter(dtensor, requires_grad=param.requires_grad))

    return partition


def _inputs(given: Placement, wanted: Placement):
    def prepare(module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (given,), run_check=False)
        if x.placements != (wanted,):
            x = x.redistribute(placements=(wanted,), async_op=True)
        return (x, *inputs[1:])

    return prepare


def _outputs(layout: Placement, use_local_output: bool):
    def prepare(module, output, mesh):
        if output.placements != (layout,):
            output = output.redistribute(placements=(layout,), async_op=True)
        return output.to_local() if use_local_output else output

    return prepare
