"""Private torch APIs outside ``torch.distributed``: fake tensors, dispatch modes, pytrees, foreach kernels,
``nn.Module``'s parameter, buffer and hook dictionaries, and the optimizers' AMP flag.

The private aten kernels (attention with its log-sum-exp, grouped matmul) are in :mod:`.torch_kernels`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Exist unchanged since torch 2.0; imported at module level (every torch this project supports has them), and
# re-exported under their own names.
from torch._subclasses.fake_tensor import FakeTensorMode as FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves as tree_leaves

from lightning_llm._compat.registry import Private, register, resolve

CHECKED = "torch 2.13.0"


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (no values: a model traced for planning). Example: ``is_fake(x)``."""
    from torch._subclasses.fake_tensor import is_fake as torch_is_fake

    return torch_is_fake(tensor)


FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""The logger of torch's fake-tensor kernels (its private module's name), silenced while a real-forward fallback
is there to take over."""

register(
    Private(
        name="torch._subclasses.fake_tensor.FakeTensorMode",
        upstream="torch",
        accessor="torch.FakeTensorMode, torch.FAKE_TENSOR_LOGGER, torch.is_fake",
        used_by=("modeling/fake.py", "modeling/activations.py", "models/moe.py"),
        why="forward of a model without allocating (planning 70B on a laptop); no public equivalent",
        caught_by="`tests/planning/test_flops.py`, `tests/planning/test_zero.py`, `tests/parallel/test_activation_checkpointing.py`",
        checked=CHECKED,
        check=lambda: (
            resolve("torch._subclasses.fake_tensor:FakeTensorMode"),
            resolve("torch._subclasses.fake_tensor:is_fake"),
        ),
    )
)
register(
    Private(
        name="torch.utils._python_dispatch.TorchDispatchMode",
        upstream="torch",
        accessor="torch.TorchDispatchMode",
        used_by=(
            "modeling/activation_tally.py",
            "modeling/tp_shares.py",
            "modeling/op_work.py",
            "parallel/init/materialize.py",
            "parallel/init/zero3_init.py",
        ),
        why="see each aten op a forward or an init runs (which outputs the selective policy saves; record and replay "
        "an init; gather a ZeRO-3 parameter on touch); torch has no public dispatch-mode base class",
        caught_by="`tests/parallel/test_activation_checkpointing.py`, `tests/strategies/test_deepspeed_init.py`",
        checked=CHECKED,
        check=lambda: resolve("torch.utils._python_dispatch:TorchDispatchMode"),
    )
)
register(
    Private(
        name="torch.utils._pytree.tree_leaves",
        upstream="torch",
        accessor="torch.tree_leaves",
        used_by=(
            "modeling/activation_tally.py",
            "modeling/tp_shares.py",
            "modeling/op_work.py",
            "parallel/init/zero3_init.py",
            "strategies/zero_auto.py",
        ),
        why="the tensors of nested args/outputs/batches; torch 2.13 ships no public `torch.utils.pytree`",
        caught_by="`tests/parallel/test_activation_checkpointing.py`, `tests/strategies/test_deepspeed_init.py`",
        checked=CHECKED,
        check=lambda: resolve("torch.utils._pytree:tree_leaves"),
    )
)


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``torch._foreach_copy_``: one fused copy of every source into its target (the optimizers' multi-tensor path).

    No public multi-tensor copy exists. Checked on torch 2.13.0.
    """
    torch._foreach_copy_(targets, sources)


register(
    Private(
        name="torch._foreach_copy_",
        upstream="torch",
        accessor="torch.foreach_copy_",
        used_by=("checkpointing/staging.py",),
        why="one fused copy of every tensor of a single-file checkpoint into its reused host buffer; no public "
        "multi-tensor copy exists",
        caught_by="`tests/strategies/test_host_staging.py`",
        checked=CHECKED,
        check=lambda: resolve("torch:_foreach_copy_"),
    )
)


def module_parameters(module: nn.Module) -> dict[str, Any]:
    """``module._parameters``: the module's own parameter slots, ``None`` entries included (``Linear(bias=False)``),
    as the live dictionary (assigning an entry swaps a parameter without ``register_parameter``'s checks).

    ``named_parameters(recurse=False)`` skips ``None`` slots and de-duplicates, and ``setattr`` refuses a plain tensor
    where a ``Parameter`` is registered; FSDP2 (``unsafe_setattr_param``) and Hugging Face swap parameters through
    this dictionary the same way. Checked on torch 2.13.0.
    """
    return module._parameters


def module_buffers(module: nn.Module) -> dict[str, Any]:
    """``module._buffers``: the module's own buffer slots, ``None`` entries included, as the live dictionary
    (see :func:`module_parameters`). Checked on torch 2.13.0."""
    return module._buffers


def swap_module_entries(module: nn.Module, entries: dict[str, Any]) -> dict[str, Any]:
    """Put ``entries`` in place of ``module._modules`` (a list's entries lent for one call); returns the previous
    dictionary, to put back. ``nn.ModuleList`` reads its length, order and items from it. Checked on torch 2.13.0."""
    previous, module._modules = module._modules, entries
    return previous


register(
    Private(
        name="nn.Module._parameters, nn.Module._buffers, nn.Module._modules",
        upstream="torch",
        accessor="torch.module_parameters, torch.module_buffers, torch.swap_module_entries",
        used_by=(
            "modeling/repeated_blocks.py",
            "parallel/init/zero3_build.py",
            "parallel/lent_weights.py",
            "parallel/pipeline/stand_ins.py",
            "parallel/tp/style_kinds.py",
            "parallel/tp/attention_heads.py",
        ),
        why='a module\'s own slots with `None` entries (block signatures, "has parameters"), and swapping a '
        "parameter in place: lend an experts module its local shards for one forward (FSDP2's "
        "`unsafe_setattr_param` and HF's `_use_local_dtensor_params` do the same), put ZeRO-3 partitions in place "
        "of meta parameters; lend a list of one module per head only this rank's heads' entries for one call",
        caught_by="`tests/parallel/test_experts_parallel.py`, `tests/strategies/test_deepspeed_init.py`, "
        "`tests/test_setup_memory.py`",
        checked=CHECKED,
        check=lambda: (nn.Linear(1, 1)._parameters, nn.BatchNorm1d(1)._buffers),
    )
)


_HOOK_SLOTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def without_hooks(module: nn.Module) -> nn.Module:
    """``module`` (a copy) with every forward and backward hook of it and its submodules dropped, in place: a copy made
    to compute alongside the original must not run the original's hooks (a callback's recorder, a split's lending).
    torch keeps hooks in private per-module dictionaries and offers no way to list or remove them without the
    handles. Checked on torch 2.13.0."""
    for sub in module.modules():
        for slot in _HOOK_SLOTS:
            hooks = getattr(sub, slot, None)
            if hooks is not None:
                hooks.clear()
    return module


def inner_hooks(module: nn.Module) -> bool:
    """Whether a forward through ``module`` runs a forward hook of one of its submodules (``module``'s own aside):
    another party's code (an expert exchange, a split's check) that a probe run beside the forward must not run."""
    return any(getattr(sub, "_forward_hooks", None) or getattr(sub, "_forward_pre_hooks", None)
               for sub in list(module.modules())[1:])  # fmt: skip


register(
    Private(
        name="nn.Module._forward_hooks and the other hook dictionaries",
        upstream="torch",
        accessor="torch.without_hooks, torch.inner_hooks",
        used_by=("parallel/tp/first_forward_parity.py", "parallel/cp/halo.py"),
        why="a copy of a block part, computed whole beside the split part in its first forward, must not run the "
        "original's hooks; torch removes hooks only through the handles their owners keep",
        caught_by="`tests/zoo/test_per_head_modules.py` (hooks counting which norms each rank runs)",
        checked=CHECKED,
        check=lambda: [getattr(nn.Linear(1, 1), slot) for slot in _HOOK_SLOTS],
    )
)


def outside_dispatch_modes():
    """A context in which the dispatch modes active around it (selective activation checkpointing's caching mode,
    a FLOP counter) do not see the ops run: a check computed beside a block's forward must not be cached as the
    block's own ops, or the recompute in backward replays the wrong outputs. Checked on torch 2.13.0."""
    return _disable_current_modes()


register(
    Private(
        name="torch.utils._python_dispatch._disable_current_modes",
        upstream="torch",
        accessor="torch.outside_dispatch_modes",
        used_by=("parallel/tp/first_forward_parity.py",),
        why="selective checkpointing caches every op a forward runs under its dispatch mode, whatever the grad mode; "
        "the first-forward check's extra ops would be replayed as the block's own; no public way to step outside",
        caught_by="`tests/parallel/test_experts_parallel.py` (experts under tp with activation checkpointing)",
        checked=CHECKED,
        check=lambda: resolve("torch.utils._python_dispatch:_disable_current_modes"),
    )
)


register(
    Private(
        name="torch.amp.GradScaler._unscale_grads_",
        upstream="torch",
        accessor="(overridden, not called: parallel/grad_scaler.DistributedGradScaler)",
        used_by=("parallel/grad_scaler.py",),
        why="the one method between GradScaler's bookkeeping and its unscale kernel: overriding it lets torch's own "
        "unscaling run on each gradient's local shard and the found-inf flag be agreed over the ranks; no public hook",
        caught_by="`tests/strategies/test_fp16_parity.py`",
        checked=CHECKED,
        check=lambda: resolve("torch.amp:GradScaler._unscale_grads_"),
    )
)


def steps_with_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` unscales gradients itself when a GradScaler steps it (torch's fused optimizers).

    ``Optimizer._step_supports_amp_scaling``, as Lightning's own ``_optimizer_handles_unscaling`` reads it.
    Checked on torch 2.13.0.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


register(
    Private(
        name="torch.optim.Optimizer._step_supports_amp_scaling",
        upstream="torch",
        accessor="torch.steps_with_amp_scaling",
        used_by=("strategies/precision.py",),
        why="a fused optimizer unscales inside its step unless the GradScaler already did; knowing which lets fp16 "
        "unscale before clipping for fused optimizers too (Lightning refuses clipping with them); no public flag",
        caught_by="`tests/strategies/test_fp16_parity.py`",
        checked=CHECKED,
        check=lambda: torch.optim.AdamW([nn.Parameter(torch.ones(1))], fused=True)._step_supports_amp_scaling,
    )
)


def memory_trackers() -> tuple[type, type]:
    """(``MemTracker``, ``FSDPMemTracker``) of ``torch.distributed._tools``: torch's per-category peak-bytes trackers of
    a real step (FSDP2's buffers attributed by the second), the oracle of the planner's tests and benchmarks. No
    public module exports them. Checked on torch 2.13.0."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker, FSDPMemTracker


register(
    Private(
        name="torch.distributed._tools.{MemTracker,FSDPMemTracker}",
        upstream="torch",
        accessor="torch.memory_trackers",
        used_by=("testing/memory.py",),
        why="the measured peak of a real step that planned memory is checked against; no public tracker attributes "
        "parameters, gradients, optimizer state and activations",
        caught_by="`tests/planning/test_planned_totals.py`",
        checked=CHECKED,
        check=memory_trackers,
    )
)
