"""Parallel degrees in one place, validated once, and the named device mesh built from them.

Mesh axes, outermost first (torchtitan's order): ``pp`` (pipeline stages), ``dp_replicate`` (HSDP replicas),
``dp_shard`` (ZeRO/FSDP shards), ``cp`` (context parallel: ranks holding shards of the same sequences) and ``tp``
(tensor parallel, innermost so its frequent collectives stay within a node). Flattened axes: ``dp`` (the ranks that
read different data), ``dp_shard_cp`` and ``dp_cp`` (what FSDP shards/reduces over with context parallelism, so CP
adds no parameter replicas). Everything else asks a :class:`ParallelDims` for sizes and sub-meshes instead of
recomputing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_llm._compat.torch_distributed import flatten_mesh

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Meshes built in this process, by device type and shape, with the world group they were built in. Each mesh makes a
# process group per axis (gloo: threads per peer) that nothing frees, so a later fit in the same process (a sweep,
# Lightning's tuner, a test session) takes the same mesh instead of adding groups; a new world builds anew.
_MESHES: dict[tuple, tuple[object, DeviceMesh, dict[str, DeviceMesh]]] = {}


@dataclass
class ParallelDims:
    """Degrees of each kind of parallelism for ``world_size`` ranks.

    ``dp_shard=-1`` takes whatever the other degrees leave: ``world_size / (pp * dp_replicate * cp * tp)``.

    Example::

        dims = ParallelDims(world_size=8, tp=2, pp=2)   # dp_shard = 2
        mesh = dims.build_mesh("cpu")
        mesh["tp"].size()  # 2
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    # The flattened axes as _flatten returned them: torch warns when a flattened axis is sliced from the root mesh.
    flattened: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp_replicate", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer.")
        others = self.tp * self.pp * self.dp_replicate * self.cp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by tp ({self.tp}) * "
                    + (f"cp ({self.cp}) * " if self.cp > 1 else "")
                    + f"pp ({self.pp}) * dp_replicate ({self.dp_replicate}) = {others}; change the degrees or the "
                    "number of devices."
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1 or others * self.dp_shard != self.world_size:
            raise ValueError(
                f"pp ({self.pp}) * dp_replicate ({self.dp_replicate}) * dp_shard ({self.dp_shard}) * "
                + (f"cp ({self.cp}) * " if self.cp > 1 else "")
                + f"tp ({self.tp}) = {others * self.dp_shard}, but the world size is {self.world_size}; the product "
                "must equal it."
            )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | str = "auto",
        dp_replicate: int = 1,
        replicate_all: bool = False,
        cp: int = 1,
    ) -> ParallelDims:
        """The degrees for ``world_size`` ranks given tp, pp and the data-parallel size (``"auto"``: what is left).

        ``replicate_all`` puts every data-parallel rank on the replicate axis (ZeRO 0); otherwise
        ``dp_replicate`` groups each shard over ``dp / dp_replicate`` ranks (HSDP when > 1).

        Example::

            ParallelDims.for_world(8, tp=2, dp_replicate=2)   # pp=1, dp_replicate=2, dp_shard=2, tp=2
        """
        if dp == "auto":
            dp = cls(world_size=world_size, tp=tp, pp=pp, cp=cp).dp_shard
        elif dp * tp * pp * cp != world_size:
            raise ValueError(
                f"data_parallel_size ({dp}) * tensor_parallel_size ({tp}) * pipeline_parallel_size ({pp})"
                + (f" * context_parallel_size ({cp})" if cp > 1 else "")
                + f" = {dp * tp * pp * cp}, but there are {world_size} processes; make the product equal devices * nodes."
            )
        if replicate_all:
            return cls(world_size=world_size, tp=tp, pp=pp, dp_replicate=dp, dp_shard=1, cp=cp)
        if dp % dp_replicate:
            raise ValueError(
                f"data_parallel_replicate_size={dp_replicate} does not divide the data-parallel size {dp}; "
                "choose a divisor so that each replica shards over the same number of ranks."
            )
        return cls(world_size=world_size, tp=tp, pp=pp, dp_replicate=dp_replicate, dp_shard=dp // dp_replicate, cp=cp)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of model replicas that read different data."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 5-D named mesh (pp, dp_replicate, dp_shard, cp, tp) plus the flattened ``dp`` axis (and, with
        context parallelism, ``dp_shard_cp`` and ``dp_cp``), and the names Lightning's ``ModelParallelStrategy`` gives
        its mesh (``data_parallel``, ``tensor_parallel``), so a ``configure_model`` written for it finds its axes here."""
        shape = tuple(getattr(self, axis) for axis in AXES)
        built = _MESHES.get((device_type, shape))
        if built is None or not dist.is_initialized() or built[0] is not dist.group.WORLD:
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)  # initializes the world if not yet
            built = _MESHES[(device_type, shape)] = (dist.group.WORLD, mesh, self._flattened(mesh))
        _, self.mesh, self.flattened = built
        return self.mesh

    def _flattened(self, mesh: DeviceMesh) -> dict[str, DeviceMesh]:
        axes = {"dp": ("dp_replicate", "dp_shard"), "data_parallel": ("dp_replicate", "dp_shard")}
        axes["tensor_parallel"] = ("tp",)
        if self.cp > 1:
            axes |= {"dp_shard_cp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp")}
        return {name: flatten_mesh(mesh[dims], name) for name, dims in axes.items()}

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D mesh of axis ``name``: one of the five or a flattened one (``dp``, ``data_parallel``, ...).

        Example::

            dims.axis("dp").get_local_rank()
        """
        return self.flattened[name] if name in self.flattened else self.mesh[name]

    def data_parallel_mesh(self) -> DeviceMesh:
        """The mesh FSDP2/replicate shards and reduces gradients over: the data-parallel ranks times the CP ranks.

        CP ranks hold the same parameters and compute gradients from different tokens of the same samples, so
        their gradients are reduced together with the data-parallel ones (torchtitan's ``dp_shard_cp``). 1-D
        unless both ``dp_replicate`` and the sharding group exceed 1 (HSDP: 2-D ``(dp_replicate, shard)``).
        """
        if self.cp == 1:
            hsdp = self.dp_replicate > 1 and self.dp_shard > 1
            return self.mesh["dp_replicate", "dp_shard"] if hsdp else self.axis("dp")
        if self.dp_shard == 1 or self.dp_replicate == 1:
            return self.axis("dp_cp")
        return self.mesh["dp_replicate", "dp_shard_cp"]

    def cp_rank(self) -> int:
        """This rank's index within its context-parallel group (which shard of each sequence it holds)."""
        return self.mesh["cp"].get_local_rank() if self.mesh is not None and self.cp > 1 else 0

    def dp_rank(self) -> int:
        """This rank's index among data-parallel replicas (tp and pp peers share it)."""
        return self.axis("dp").get_local_rank() if self.mesh is not None else 0
