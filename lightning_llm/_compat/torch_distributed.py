"""Private ``torch.distributed`` APIs: composable checkpoint and replicate, functional collectives, device-mesh
flattening, parallel-style application, DTensor's local shard, and DCP's whole-checkpoint load and fsspec storage.

Everything from a private module is imported when called, so a torch that lacks it (the oldest supported torch
may) fails only the feature that needs it, with a ``RuntimeError`` naming that feature.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_llm._compat.registry import Private, missing, register, resolve

CHECKED = "torch 2.13.0"


def composable_checkpoint():
    """``torch.distributed._composable.checkpoint``: the composable, hook-based activation checkpoint (call it on a
    module; ``.state(module)`` is not ``None`` once applied). Parameter names stay unchanged and it composes with TP,
    FSDP2, per-block compile and pipeline stages, which ``torch.utils.checkpoint``'s wrapper does not; no public
    module exports it. Checked on torch 2.13.0."""
    try:
        from torch.distributed._composable import checkpoint
    except ImportError as err:
        raise missing(
            "Activation checkpointing", "torch.distributed._composable.checkpoint (torch >= 2.4)", err
        ) from err
    return checkpoint


register(
    Private(
        name="torch.distributed._composable.checkpoint",
        upstream="torch",
        accessor="torch_distributed.composable_checkpoint",
        used_by=("parallel/activation_checkpointing.py",),
        why="the composable, hook-based checkpoint: parameter names unchanged, composes with TP, FSDP2, per-block "
        "compile and pipeline stages; `torch.utils.checkpoint` is used through it",
        caught_by="`tests/parallel/test_activation_checkpointing.py`",
        checked=CHECKED,
        check=lambda: composable_checkpoint().state,
    )
)


def functional_collective_ops(names: tuple[str, ...]) -> set:
    """The ``.default`` overloads of ``torch.ops._c10d_functional.<name>`` present in this torch (those of ``names``
    it lacks are left out): the ops a tensor-parallel forward records for its reductions. Their namespace is
    private; no public name identifies these ops. Checked on torch 2.13.0."""
    ops = torch.ops._c10d_functional
    return {getattr(ops, name).default for name in names if hasattr(ops, name)}


register(
    Private(
        name="torch.ops._c10d_functional.{all_reduce,reduce_scatter_tensor}",
        upstream="torch",
        accessor="torch_distributed.functional_collective_ops",
        used_by=("parallel/activation_checkpointing.py",),
        why="the selective policy saves TP reduction outputs so backward does not repeat a collective",
        caught_by="`tests/parallel/test_activation_checkpointing.py` (tp2 collective count)",
        checked=CHECKED,
        check=lambda: (
            torch.ops._c10d_functional.all_reduce.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
        ),
    )
)


def _funcol():
    try:
        from torch.distributed import _functional_collectives
    except ImportError as err:
        raise missing("Fused tensor-parallel projections", "torch.distributed._functional_collectives", err) from err
    return _functional_collectives


def all_to_all_single(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """``torch.distributed._functional_collectives.all_to_all_single`` then ``wait_tensor``: the all-to-all with
    autograd (its backward is the reverse all-to-all). torch 2.13 deprecates the public
    ``torch.distributed.nn.functional.all_to_all_single`` and names this one as its replacement. Checked on torch
    2.13.0."""
    funcol = _funcol()
    return funcol.wait_tensor(funcol.all_to_all_single(tensor, output_splits, input_splits, group))


register(
    Private(
        name="torch.distributed._functional_collectives.all_to_all_single (and wait_tensor)",
        upstream="torch",
        accessor="torch_distributed.all_to_all_single",
        used_by=("parallel/tp/fused.py", "parallel/ep/dispatch.py", "parallel/ep/expert_list.py"),
        why="the all-to-all that regroups a fused projection's output per rank, with autograd; torch 2.13 deprecates "
        "the public `torch.distributed.nn.functional.all_to_all_single` and names this one as its replacement",
        caught_by="`tests/parallel/test_fused_projections.py` (float64 gradients)",
        checked=CHECKED,
        check=lambda: (_funcol().all_to_all_single, _funcol().wait_tensor),
    )
)


def flatten_mesh(mesh, name: str):
    """``DeviceMesh._flatten(name)``: a flattened axis over several mesh dimensions (the ``dp`` axis over
    ``dp_replicate`` x ``dp_shard``), reachable afterwards as ``root_mesh[name]``. No public API builds one;
    torchtitan uses the same. Checked on torch 2.13.0."""
    try:
        flatten = mesh._flatten
    except AttributeError as err:
        raise missing("The flattened data-parallel mesh axis", "DeviceMesh._flatten (torch >= 2.4)", err) from err
    return flatten(name)


register(
    Private(
        name="DeviceMesh._flatten",
        upstream="torch",
        accessor="torch_distributed.flatten_mesh",
        used_by=("parallel/mesh.py",),
        why="the flattened `dp` axis over (dp_replicate, dp_shard), and `dp_shard_cp`/`dp_cp` with context "
        "parallelism; torchtitan uses the same",
        caught_by="every multi-rank parity test, `tests/strategies/test_parallel_parity.py`",
        checked=CHECKED,
        check=lambda: resolve("torch.distributed.device_mesh:DeviceMesh._flatten"),
    )
)


def unflatten_mesh(mesh, sizes: tuple[int, ...], names: tuple[str, ...]):
    """``DeviceMesh._unflatten(0, sizes, names)``: split a 1-D mesh (the flattened ``dp`` axis) into named axes that
    keep the root mesh, so FSDP2 can shard a DTensor of one of them over another (the expert-parallel ``ep`` axis and
    the data-parallel ranks outside it, as torchtitan builds them). No public API splits an axis. Checked on torch
    2.13.0."""
    try:
        unflatten = mesh._unflatten
    except AttributeError as err:
        raise missing("Expert parallelism's mesh axes", "DeviceMesh._unflatten (torch >= 2.9)", err) from err
    return unflatten(0, sizes, names)


register(
    Private(
        name="DeviceMesh._unflatten",
        upstream="torch",
        accessor="torch_distributed.unflatten_mesh",
        used_by=("parallel/ep/mesh.py",),
        why="split the flattened `dp` axis into (`edp`, `ep`) axes of the same root mesh, so FSDP2 shards the "
        "experts' `ep` DTensors over `edp`; torchtitan builds its EP axes the same way",
        caught_by="`tests/strategies/test_expert_parallel_parity.py`",
        checked=CHECKED,
        check=lambda: resolve("torch.distributed.device_mesh:DeviceMesh._unflatten"),
    )
)


def replicate_with_fsdp(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.distributed._composable.replicate_with_fsdp.replicate``: DDP semantics on FSDP2's engine, composing
    with tensor-parallel DTensor parameters and per-block units as ``fully_shard`` does. torch has no public
    FSDP2-style replicate (``torch.distributed._composable.replicate`` is the old DDP-reducer one, which does not
    compose with ``fully_shard``). Checked on torch 2.13.0."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError as err:
        raise missing(
            "ZeRO stage 0 (FSDP2-style replicate)",
            f"torch.distributed._composable.replicate_with_fsdp (present in {CHECKED}, not in torch {torch.__version__})",
            err,
        ) from err
    return replicate(module, **kwargs)


register(
    Private(
        name="torch.distributed._composable.replicate_with_fsdp.replicate",
        upstream="torch",
        accessor="torch_distributed.replicate_with_fsdp",
        used_by=("parallel/data_parallel.py",),
        why="ZeRO 0 on FSDP2's engine (DDP semantics composing with TP and FSDP2 units); no public FSDP2-style "
        "replicate (the public-looking `torch.distributed._composable.replicate` is the old DDP-reducer one)",
        caught_by="`tests/strategies/test_parallel_parity.py` (dp2 zero0)",
        checked=CHECKED,
        check=lambda: resolve("torch.distributed._composable.replicate_with_fsdp:replicate"),
    )
)


def apply_parallel_style(style, module: nn.Module, device_mesh) -> nn.Module:
    """``ParallelStyle._apply(module, mesh)``: torch's extension point for a parallel style (``parallelize_module``
    calls it); a composite style applies torch's own ``ColwiseParallel`` through it. ``parallelize_module`` itself
    would need a module path and a root. Checked on torch 2.13.0."""
    return style._apply(module, device_mesh)


register(
    Private(
        name="ParallelStyle._apply",
        upstream="torch",
        accessor="torch_distributed.apply_parallel_style",
        used_by=("parallel/tp/fused.py", "parallel/tp/float8.py", "parallel/tp/styles.py"),
        why="torch's extension point for a parallel style; `FusedColwise` applies torch's `ColwiseParallel` (or the "
        "Conv1D style) through it before adding its regrouping hook, `Float8Split` torchao's float8 styles or "
        "torch's, `SequenceParallelNorm` torch's `SequenceParallel` (our styles also override it)",
        caught_by="`tests/parallel/test_fused_projections.py`, `tests/strategies/test_fp8_tensor_parallel.py`",
        checked=CHECKED,
        check=lambda: resolve("torch.distributed.tensor.parallel:ColwiseParallel._apply"),
    )
)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``DTensor._local_tensor``: this rank's shard itself, without ``to_local()``'s autograd node (used inside
    autograd's pack hook, where a new graph node is not allowed). Checked on torch 2.13.0."""
    return t._local_tensor


register(
    Private(
        name="DTensor._local_tensor",
        upstream="torch",
        accessor="torch_distributed.local_tensor",
        used_by=("modeling/activation_tally.py",),
        why="count each saved storage once inside autograd's pack hook, where `to_local()` would add a graph node",
        caught_by="`tests/parallel/test_activation_checkpointing.py` (fake vs real measurement equality)",
        checked=CHECKED,
        check=lambda: _dtensor_local_tensor_slot(),
    )
)


def _dtensor_local_tensor_slot() -> None:
    from torch.distributed.tensor import DTensor

    if "_local_tensor" not in getattr(DTensor, "__slots__", ()):
        raise AttributeError("DTensor no longer has a _local_tensor slot")


def load_whole_checkpoint(storage_reader, planner_mixin: type | None = None) -> dict:
    """Every entry of a DCP checkpoint into one process's memory, without a process group: DCP's
    ``state_dict_loader._load_state_dict(..., planner=format_utils._EmptyStateDictLoadPlanner(), no_dist=True)``,
    as Lightning's ``_load_distributed_checkpoint`` and torch's ``dcp_to_torch_save`` do. The public ``dcp.load``
    fills only the keys of the state dict it is given (none, here). ``planner_mixin`` is mixed into the planner
    (``untrusted.WeightsOnlyBytes``: byte entries unpickled weights-only). Checked on torch 2.13.0."""
    try:
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as err:
        raise missing(
            "Loading a whole sharded checkpoint", "DCP's _load_state_dict/_EmptyStateDictLoadPlanner", err
        ) from err
    state: dict = {}
    planner_class = _EmptyStateDictLoadPlanner
    if planner_mixin is not None:
        planner_class = type(f"{planner_mixin.__name__}Planner", (planner_mixin, _EmptyStateDictLoadPlanner), {})
    _load_state_dict(state, storage_reader=storage_reader, planner=planner_class(), no_dist=True)
    return state


register(
    Private(
        name="torch.distributed.checkpoint.state_dict_loader._load_state_dict, format_utils._EmptyStateDictLoadPlanner",
        upstream="torch",
        accessor="torch_distributed.load_whole_checkpoint",
        used_by=("checkpointing/files.py",),
        why="load every entry of a sharded checkpoint in one process (as Lightning's `_load_distributed_checkpoint`); "
        "public `dcp.load` fills only the keys it is given",
        caught_by="`tests/strategies/test_parallel_strategy.py` (consolidation)",
        checked=CHECKED,
        check=lambda: (
            resolve("torch.distributed.checkpoint.state_dict_loader:_load_state_dict"),
            resolve("torch.distributed.checkpoint.format_utils:_EmptyStateDictLoadPlanner"),
        ),
    )
)


def _fsspec():
    try:
        from torch.distributed.checkpoint import _fsspec_filesystem
    except ImportError as err:
        raise missing(
            "Checkpoints on a remote filesystem", "torch.distributed.checkpoint._fsspec_filesystem and fsspec", err
        ) from err
    return _fsspec_filesystem


def fsspec_writer(path: str):
    """``torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter(path)``: DCP's writer for a URL (s3://, gs://,
    ...). torch 2.13 does not export it from ``torch.distributed.checkpoint``. Checked on torch 2.13.0."""
    return _fsspec().FsspecWriter(path)


def fsspec_reader(path: str):
    """``torch.distributed.checkpoint._fsspec_filesystem.FsspecReader(path)``: the reader matching
    :func:`fsspec_writer`. Checked on torch 2.13.0."""
    return _fsspec().FsspecReader(path)


register(
    Private(
        name="torch.distributed.checkpoint._fsspec_filesystem.{FsspecWriter,FsspecReader}",
        upstream="torch",
        accessor="torch_distributed.fsspec_writer, torch_distributed.fsspec_reader",
        used_by=("checkpointing/fs.py",),
        why="DCP storage on a URL (a `checkpoint_id` alone would write the URL into a local directory of that name); "
        "torch 2.13 does not export them publicly",
        caught_by="remote-filesystem checkpoint tests (`tests/checkpointing/`)",
        checked=CHECKED,
        check=lambda: (_fsspec().FsspecWriter, _fsspec().FsspecReader),
    )
)
