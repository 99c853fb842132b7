"""The expert-parallel mesh axes, carved out of the data-parallel ranks as torchtitan carves them out of dp_shard.

Expert parallelism adds no ranks: the flattened ``dp`` axis (dp_replicate x dp_shard) is split into ``edp x ep``,
``ep`` innermost, so each EP group is ``ep`` neighbouring data-parallel ranks. The experts of a layer are split over
``ep`` (whole experts per rank) and data-parallel over ``edp``, the data-parallel ranks outside their EP group
(ZeRO shards them there; with ``ep == dp`` that axis has one rank). Both axes keep the root mesh, so FSDP2 can shard
the experts' ``ep`` DTensors over ``edp``. The mesh of :class:`~lightning_llm.parallel.mesh.ParallelDims` is
untouched: these are extra views of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from lightning_llm._compat.torch_distributed import unflatten_mesh
from lightning_llm.parallel.mesh import ParallelDims


@dataclass(frozen=True)
class ExpertMeshes:
    """The experts' axes: ``ep`` splits them by expert, ``edp`` is data parallel over the ranks outside ``ep``."""

    ep: DeviceMesh
    edp: DeviceMesh
    dp: int  # every data-parallel rank: expert gradients are averaged over all of them


def check_expert_parallel_size(ep: int, dp: int) -> None:
    """Refuse an EP size that does not divide the data-parallel size (EP groups are carved out of dp)."""
    if ep > dp or dp % ep:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide the data-parallel size {dp}: the expert-parallel groups are "
            f"carved out of the data-parallel ranks. Use an expert_parallel_size that divides {dp}, or change "
            "data_parallel_size / the number of devices."
        )


def build_expert_meshes(dims: ParallelDims, ep: int) -> ExpertMeshes:
    """Split the built mesh's ``dp`` axis into ``(edp, ep)`` views (a collective: every rank calls it).

    Example::

        dims = ParallelDims(world_size=4)
        dims.build_mesh("cpu")
        meshes = build_expert_meshes(dims, ep=2)   # meshes.ep.size() == 2, meshes.edp.size() == 2
    """
    check_expert_parallel_size(ep, dims.dp)
    split = unflatten_mesh(dims.axis("dp"), (dims.dp // ep, ep), ("edp", "ep"))
    return ExpertMeshes(ep=split["ep"], edp=split["edp"], dp=dims.dp)
