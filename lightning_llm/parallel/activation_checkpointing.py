"""Activation checkpointing of transformer blocks: full, selective (op or layer policy) and budget-driven.

Every mode applies torch's composable ``checkpoint(block, context_fn=...)``
(``torch.distributed._composable``: non-reentrant checkpointing through forward hooks), so the
block's ``forward`` is untouched and parameter names, state dicts and tensor-parallel plans are
unchanged (torch's ``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module`` into every
name). FSDP2's hooks, applied afterwards, run inside the checkpointed region and again in the
recompute, which FSDP2 supports (torch tests ``fully_shard`` with this ``checkpoint``).

* ``"full"``: every block keeps only its input and recomputes everything in backward.
* ``"selective"``, ``selective="op"``: keep the outputs of matmuls, attention and tensor-parallel
  reductions, recompute the cheap pointwise ops (norms, activations, rotary), through
  ``create_selective_checkpoint_contexts``; ``recompute_every_other_matmul`` also recomputes the
  2nd, 4th, ... matmul of each block, as torchtitan does. ``selective="layer"``: checkpoint every
  ``every_n_layers``-th block fully.
* ``"auto"``: measure what each block keeps (:mod:`lightning_llm.modeling.activations`) and
  give the fewest blocks the cheapest policy that brings the predicted peak under a budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_llm._compat.torch_distributed import composable_checkpoint, functional_collective_ops
from lightning_llm.modeling.activations import BlockActivations, measure_blocks
from lightning_llm.modeling.blocks import entry_modules
from lightning_llm.parallel.devices import total_device_memory
from lightning_llm.parallel.kv_cache import refuse_cache_argument
from lightning_llm.planning.activation_budget import plan_for_budget, predicted_peak, resolve_budget, validate_budget

log = logging.getLogger(__name__)

MODES = ("none", "full", "selective", "auto")
SELECTIVE_POLICIES = ("op", "layer")

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_ATTENTION = {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)
}
# Tensor-parallel outputs: recomputing them would repeat a collective in backward.
_COLLECTIVES = functional_collective_ops(("reduce_scatter_tensor", "all_reduce"))


def saves_output(op) -> bool:
    """Whether the selective op policy keeps ``op``'s output (matmul, attention, TP reduction)."""
    return op in _MATMULS or op in _ATTENTION or op in _COLLECTIVES


def _op_policy(recompute_every_other_matmul: bool) -> Callable:
    """A selective-checkpoint policy for one call of one block (forward and its recompute)."""
    # Counted per pass: torch versions that ask the policy again during recompute get the same answers.
    matmuls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        if op in _MATMULS and recompute_every_other_matmul:
            matmuls[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if saves_output(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context(recompute_every_other_matmul: bool) -> Callable:
    return lambda: create_selective_checkpoint_contexts(_op_policy(recompute_every_other_matmul))


def checkpoint_block(block: nn.Module, context_fn: Callable | None = None) -> None:
    """Checkpoint ``block`` with torch's composable ``checkpoint`` (selective when ``context_fn`` is given).

    Example::

        checkpoint_block(model.layers[0])   # full recomputation of block 0 in backward
    """
    options = {"use_reentrant": False, "preserve_rng_state": True}
    if context_fn is not None:
        options["context_fn"] = context_fn
    try:
        composable_checkpoint()(block, **options)
    except AssertionError as err:  # torch's composable APIs refuse a second application this way
        raise RuntimeError(
            f"{type(block).__name__} is already activation-checkpointed; apply checkpointing once per block."
        ) from err
    block.register_forward_pre_hook(_refuse_kv_cache, with_kwargs=True)


def _refuse_kv_cache(block: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.is_grad_enabled():  # generation (no backward, nothing recomputed) keeps its cache
        refuse_cache_argument(block, kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    """Whether :func:`checkpoint_block` (torch's composable ``checkpoint``) was applied to ``block``."""
    return composable_checkpoint().state(block) is not None


@dataclass
class ACReport:
    """What :func:`apply_activation_checkpointing` did.

    Attributes:
        mode: the mode asked for.
        policies: per block, "none", "op" (selective by operator) or "full".
        measured: per block, the bytes kept for backward under each policy ("auto" only).
        predicted_bytes: predicted peak of the blocks' activations with these policies ("auto" only).
        budget_bytes: the budget in bytes ("auto" only).
    """

    mode: str
    policies: list[str] = field(default_factory=list)
    measured: list[BlockActivations] | None = None
    predicted_bytes: int | None = None
    budget_bytes: int | None = None

    @property
    def checkpointed(self) -> int:
        return sum(p != "none" for p in self.policies)

    def summary(self, selective: str = "op") -> str:
        label = f"selective {selective}" if self.mode == "selective" else self.mode
        if self.mode == "auto" and self.budget_bytes is not None:
            counts = (
                ", ".join(f"{self.policies.count(p)} {p}" for p in ("op", "full") if p in self.policies) or "nothing"
            )
            label += (
                f": {counts}; predicted {self.predicted_bytes / 2**20:.1f} MiB within "
                f"{self.budget_bytes / 2**20:.1f} MiB"
            )
        return f"Applied activation checkpointing ({label}) to {self.checkpointed} of {len(self.policies)} blocks"


def validate_options(mode: str, selective: str = "op", every_n_layers: int = 2) -> None:
    """Refuse unknown modes and policies before anything is built."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not a mode; choose one of {MODES}.")
    if selective not in SELECTIVE_POLICIES:
        raise ValueError(
            f"selective={selective!r} is not a policy; choose one of {SELECTIVE_POLICIES}: 'op' (save matmul and "
            "attention outputs, recompute pointwise ops) or 'layer' (checkpoint every n-th block)."
        )
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(f"every_n_layers={every_n_layers!r} must be an integer of at least 1 (1 = every block).")


def block_policies(
    mode: str,
    indices: Sequence[int],
    selective: str = "op",
    every_n_layers: int = 2,
    auto_policies: Sequence[str] | None = None,
) -> list[str]:
    """The policy ("none", "op" or "full") of the blocks at model positions ``indices``."""
    validate_options(mode, selective, every_n_layers)
    if mode == "auto":
        if auto_policies is None or len(auto_policies) != len(indices):
            raise ValueError(
                "activation_checkpointing='auto' needs one planned policy per block (see plan_for_budget)."
            )
        unknown = set(auto_policies) - {"none", "op", "full"}
        if unknown:
            raise ValueError(f"Planned policies {sorted(unknown)} are not policies; use 'none', 'op' or 'full'.")
        return list(auto_policies)
    if mode == "selective" and selective == "layer":
        return ["full" if i % every_n_layers == 0 else "none" for i in indices]
    return [{"none": "none", "full": "full", "selective": "op"}[mode]] * len(indices)


def apply_activation_checkpointing(
    blocks: nn.ModuleList | Sequence[nn.Module],
    *,
    mode: str,
    selective: str = "op",
    every_n_layers: int = 2,
    recompute_every_other_matmul: bool = False,
    budget: int | float | None = None,
    device_memory: int | None = None,
    measure_fn: Callable[[], object] | None = None,
    auto_policies: Sequence[str] | None = None,
    block_indices: Sequence[int] | None = None,
    entries: dict[int, list[nn.Module]] | None = None,
) -> ACReport:
    """Checkpoint ``blocks`` in place; call it after tensor parallelism and before FSDP2 sharding.

    Arguments:
        blocks: the transformer blocks (see :func:`~lightning_llm.modeling.blocks.find_blocks`).
        mode: "none", "full", "selective" or "auto".
        selective: for "selective": "op" (per operator) or "layer" (every ``every_n_layers``-th block).
        every_n_layers: the layer policy checkpoints blocks 0, n, 2n, ...
        recompute_every_other_matmul: the op policy also recomputes every second matmul of a block.
        budget: for "auto": the peak bytes the blocks' activations may take, as bytes (int) or as a
            fraction (float in (0, 1]) of ``device_memory``.
        device_memory: bytes of the device; default: what the blocks' device reports.
        measure_fn: for "auto": runs one forward of the model holding ``blocks`` on a real-shaped
            micro-batch; each block is measured during it (see :func:`measure_blocks`).
        auto_policies: for "auto", a plan made beforehand (one of "none"/"op"/"full" per block),
            instead of ``budget`` and ``measure_fn``.
        block_indices: the blocks' positions in the whole model, which the layer policy counts
            (a pipeline stage holds a slice); default 0, 1, ...
        entries: block (by id) -> the modules it is entered through, where the model does not call it as a
            whole (default: :func:`~lightning_llm.modeling.blocks.entry_modules`); each is checkpointed.

    Example::

        report = apply_activation_checkpointing(model.layers, mode="selective", selective="op")
        report = apply_activation_checkpointing(
            model.layers, mode="auto", budget=2 * 2**30, measure_fn=lambda: model(tokens)
        )
    """
    blocks = list(blocks)
    validate_options(mode, selective, every_n_layers)
    _refuse_missing_inputs(blocks, mode, budget, measure_fn, auto_policies)
    indices = _positions(blocks, block_indices)
    report = ACReport(mode=mode)
    if mode == "auto" and auto_policies is None:
        auto_policies = _plan_auto(blocks, report, budget, device_memory, measure_fn)
    report.policies = block_policies(mode, indices, selective, every_n_layers, auto_policies)
    _checkpoint_blocks(blocks, report.policies, _selective_context(recompute_every_other_matmul), entries or {})
    if mode != "none":
        log.info(report.summary(selective))
    return report


def _refuse_missing_inputs(blocks: list[nn.Module], mode: str, budget, measure_fn, auto_policies) -> None:
    """Refuse, before anything is measured or changed, no blocks, and an "auto" without a plan nor what makes one."""
    if not blocks:
        raise ValueError("apply_activation_checkpointing got no blocks; pass the model's nn.ModuleList of blocks.")
    if mode == "auto" and auto_policies is None:
        if measure_fn is None:
            raise ValueError(
                "activation_checkpointing='auto' needs measure_fn: a callable running one forward of the model."
            )
        validate_budget(budget)


def _positions(blocks: list[nn.Module], block_indices: Sequence[int] | None) -> list[int]:
    """The blocks' positions in the whole model: ``block_indices``, checked, or 0, 1, ..."""
    indices = list(block_indices) if block_indices is not None else list(range(len(blocks)))
    if len(indices) != len(blocks):
        raise ValueError(f"block_indices has {len(indices)} entries for {len(blocks)} blocks; give one per block.")
    return indices


def _checkpoint_blocks(blocks: list[nn.Module], policies: list[str], selective: Callable, entries: dict) -> None:
    """Checkpoint every module each block is entered through, fully or with the ``selective`` context."""
    for block, policy in zip(blocks, policies):
        if policy != "none":
            for unit in entries.get(id(block)) or entry_modules(block):
                checkpoint_block(unit, selective if policy == "op" else None)


def _plan_auto(blocks, report: ACReport, budget, memory: int | None, measure_fn) -> list[str]:
    """Measure every block once and plan the cheapest policies under the budget (fills ``report``)."""
    if isinstance(budget, float) and memory is None:
        memory = total_device_memory(next(p for b in blocks for p in b.parameters()).device)
    report.budget_bytes = resolve_budget(budget, memory)
    report.measured = measure_blocks(blocks, measure_fn, saves_output=saves_output)
    saved = [m.saved for m in report.measured]
    policies, report.predicted_bytes = plan_for_budget(
        saved, [m.input for m in report.measured], report.budget_bytes, op=[m.op for m in report.measured]
    )
    return policies


@dataclass
class ACOptions:
    """The knobs of one mode as plain values a config file can set (``activation_checkpointing_options``)."""

    selective: Literal["op", "layer"] = "op"
    every_n_layers: int = 2
    recompute_every_other_matmul: bool = False
    budget: int | float | None = None
    device_memory: int | None = None

    @classmethod
    def from_dict(cls, mode: str, options: ACOptions | dict | None) -> ACOptions:
        """Checked options for ``mode`` from a dataclass (the CLI parses configs into one) or a dict (Python)."""
        options = asdict(options) if isinstance(options, ACOptions) else dict(options or {})
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"Unknown activation_checkpointing_options {sorted(unknown)}; allowed: {sorted(cls.__dataclass_fields__)}."
            )
        result = cls(**options)
        validate_options(mode, result.selective, result.every_n_layers)
        if mode == "auto":
            if result.budget is None:
                raise ValueError(
                    "activation_checkpointing='auto' needs activation_checkpointing_options={'budget': ...}: bytes (int) "
                    "or a fraction of device memory (float in (0, 1])."
                )
            validate_budget(result.budget)
        return result


__all__ = [
    "MODES",
    "SELECTIVE_POLICIES",
    "ACOptions",
    "ACReport",
    "apply_activation_checkpointing",
    "block_policies",
    "checkpoint_block",
    "is_checkpointed",
    "plan_for_budget",
    "predicted_peak",
    "resolve_budget",
    "saves_output",
    "validate_budget",
    "validate_options",
]
