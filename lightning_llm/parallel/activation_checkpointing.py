"""Activation checkpointing of transformer blocks: full, selective (op or layer policy) and budget-driven.

All modes wrap the block's ``forward`` in place with non-reentrant ``torch.utils.checkpoint``, so
parameter names, state dicts and tensor-parallel plans are unchanged, and FSDP2's per-block hooks
(installed afterwards) sit outside the checkpointed region, exactly as with torch's
``checkpoint_wrapper``, which would rename every parameter.

* ``"full"``: every block saves only its inputs and recomputes everything in backward.
* ``"selective"``, ``selective="op"``: save the outputs of matmuls and attention, recompute the
  cheap pointwise ops (norms, activations, rotary); ``recompute_every_other_matmul`` also
  recomputes every second matmul, as torchtitan does. ``selective="layer"``: checkpoint every
  ``every_n_layers``-th block fully.
* ``"auto"``: given a budget for the activations the blocks keep for backward, checkpoint the
  fewest, heaviest blocks that fit, from per-block bytes measured once (see
  :mod:`lightning_llm.parallel.activation_memory`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

log = logging.getLogger(__name__)

MODES = ("none", "full", "selective", "auto")
SELECTIVE_POLICIES = ("op", "layer")

_aten = torch.ops.aten
# Outputs worth keeping: expensive to recompute, and what backward needs anyway.
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_ATTENTION = {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
}


@dataclass
class ACOptions:
    """The knobs of one activation-checkpointing mode, as plain values a config file can set."""

    selective: str = "op"
    every_n_layers: int = 2
    recompute_every_other_matmul: bool = False
    budget: int | float | None = None
    device_memory: int | None = None

    @classmethod
    def from_dict(cls, mode: str, options: dict | None) -> ACOptions:
        options = dict(options or {})
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"Unknown activation_checkpointing_options {sorted(unknown)}; allowed: {sorted(cls.__dataclass_fields__)}."
            )
        result = cls(**options)
        validate_options(mode, result.selective, result.every_n_layers)
        if mode == "auto" and result.budget is None:
            raise ValueError(
                "activation_checkpointing='auto' needs activation_checkpointing_options={'budget': ...}: bytes (int) or a "
                "fraction of device memory (float in (0, 1])."
            )
        return result


def validate_options(mode: str, selective: str = "op", every_n_layers: int = 2) -> None:
    """Refuse unknown modes and policies before anything is built."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not a mode; choose one of {MODES}.")
    if selective not in SELECTIVE_POLICIES:
        raise ValueError(f"selective={selective!r} is not a policy; choose 'op' (per operator) or 'layer' (every n-th block).")
    if every_n_layers < 1:
        raise ValueError(f"every_n_layers={every_n_layers} must be at least 1.")


def _op_policy(recompute_every_other_matmul: bool):
    def policy(ctx, op, *args, **kwargs):
        if op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMULS:
            if recompute_every_other_matmul:
                # Count per pass (forward and recompute count alike) and keep every second matmul.
                key = "recompute" if ctx.is_recompute else "forward"
                ctx_counts = policy.counts
                ctx_counts[key] += 1
                return CheckpointPolicy.MUST_SAVE if ctx_counts[key] % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.counts = defaultdict(int)
    return policy


def _context_fn(recompute_every_other_matmul: bool):
    def make():
        policy = _op_policy(recompute_every_other_matmul)
        return create_selective_checkpoint_contexts(policy)

    return make


def checkpoint_block(block: nn.Module, context_fn=None) -> None:
    """Wrap ``block.forward`` in non-reentrant checkpointing (selective when ``context_fn`` is given)."""
    inner = block.forward
    kwargs = {"use_reentrant": False, "preserve_rng_state": True}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn

    def forward(*args, **kw):
        return checkpoint(inner, *args, **kwargs, **kw)

    block.forward = forward
    block._activation_checkpointing_inner = inner


@dataclass
class ACReport:
    """Which block got which policy, and the activation bytes behind an ``"auto"`` decision."""

    mode: str
    policies: list[str] = field(default_factory=list)
    measured_bytes: list[int] = field(default_factory=list)
    predicted_bytes: int | None = None
    budget: int | None = None

    @property
    def checkpointed(self) -> int:
        return sum(p != "none" for p in self.policies)


def apply_activation_checkpointing(
    blocks: list[nn.Module],
    *,
    mode: str,
    selective: str = "op",
    every_n_layers: int = 2,
    recompute_every_other_matmul: bool = False,
    auto_policies: list[str] | None = None,
    block_indices: list[int] | None = None,
) -> ACReport:
    """Checkpoint ``blocks`` in place according to ``mode``; see the module docstring.

    ``auto_policies`` ("none" or "full" per block) is what :func:`plan_for_budget` chose for ``"auto"``;
    ``block_indices`` are the blocks' positions in the model (a pipeline stage holds a slice), which
    the layer policy counts from.

    Example::

        apply_activation_checkpointing(list(model.layers), mode="selective", selective="op")
    """
    indices = list(block_indices) if block_indices is not None else list(range(len(blocks)))
    policies = block_policies(mode, indices, selective, every_n_layers, auto_policies)
    context = _context_fn(recompute_every_other_matmul)
    for block, policy in zip(blocks, policies):
        if policy == "full":
            checkpoint_block(block)
        elif policy == "op":
            checkpoint_block(block, context)
    report = ACReport(mode=mode, policies=policies)
    if mode != "none":
        label = f"{mode} {selective}" if mode == "selective" else mode
        log.info("Applied activation checkpointing (%s) to %d of %d blocks", label, report.checkpointed, len(blocks))
    return report


def block_policies(
    mode: str, indices: list[int], selective: str = "op", every_n_layers: int = 2, auto_policies: list[str] | None = None
) -> list[str]:
    """The policy ("none", "full" or "op") of each block at the given positions."""
    validate_options(mode, selective, every_n_layers)
    if mode == "auto":
        if auto_policies is None or len(auto_policies) != len(indices):
            raise ValueError("activation_checkpointing='auto' needs the per-block plan from plan_for_budget().")
        return list(auto_policies)
    if mode == "selective" and selective == "layer":
        return ["full" if i % every_n_layers == 0 else "none" for i in indices]
    return [{"none": "none", "full": "full", "selective": "op"}[mode]] * len(indices)


def plan_for_budget(saved_bytes: list[int], input_bytes: list[int], budget: int) -> tuple[list[str], int]:
    """The fewest blocks to checkpoint fully, heaviest first, so the kept activations fit ``budget``.

    A checkpointed block keeps only its input; the others keep everything they save. Returns the
    per-block policies and the predicted bytes. Refuses a budget below what checkpointing every
    block achieves, with the numbers.
    """
    floor = sum(input_bytes)
    if budget < floor:
        raise ValueError(
            f"The activation budget {budget / 2**20:.1f} MiB is below what full checkpointing of every block "
            f"keeps ({floor / 2**20:.1f} MiB of block inputs; without checkpointing {sum(saved_bytes) / 2**20:.1f} MiB). "
            "Raise the budget, use a smaller micro-batch, or shard the sequence (sequence_parallel)."
        )
    policies = ["none"] * len(saved_bytes)
    predicted = sum(saved_bytes)
    for index in sorted(range(len(saved_bytes)), key=lambda i: saved_bytes[i] - input_bytes[i], reverse=True):
        if predicted <= budget:
            break
        policies[index] = "full"
        predicted += input_bytes[index] - saved_bytes[index]
    return policies, predicted


def resolve_budget(budget: int | float | None, device_memory: int | None) -> int:
    """Bytes from an absolute budget (int) or a fraction (float in (0, 1]) of ``device_memory``."""
    if budget is None:
        raise ValueError("activation_checkpointing='auto' needs activation_budget: bytes, or a fraction of device memory.")
    if isinstance(budget, float) and budget <= 1:
        if not 0 < budget:
            raise ValueError(f"activation_budget={budget} as a fraction must lie in (0, 1].")
        if device_memory is None:
            raise ValueError("A fractional activation_budget needs the device memory size.")
        return int(budget * device_memory)
    if budget <= 0:
        raise ValueError(f"activation_budget={budget} bytes must be positive.")
    return int(budget)

