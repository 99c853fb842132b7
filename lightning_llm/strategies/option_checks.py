"""Each of LLMParallelStrategy's options checked on its own: the ``check=`` of its declaration in
:mod:`~lightning_llm.strategies.parallel_options`.

A check is ``check(name, value) -> the value kept``: it refuses an impossible value before any process starts,
naming the value and the fix, and returns the value as the code reads it (``fp8=True`` kept as ``"tensorwise"``).
Checks that span several options are in :mod:`~lightning_llm.strategies.option_combinations`.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_llm.parallel.activation_checkpointing import ACOptions, validate_options
from lightning_llm.parallel.cp.apply import check_method
from lightning_llm.parallel.ep.apply import check_plan as check_expert_parallel_plan
from lightning_llm.parallel.float8 import validate_fp8
from lightning_llm.parallel.pipeline.split import SCHEDULES
from lightning_llm.parallel.tp.plan import check_style
from lightning_llm.strategies.declarations import Check
from lightning_llm.validation import check_choice, check_int, check_memory_size


def positive_int(hint: str = "", *, optional: bool = False) -> Check:
    """An integer of at least 1 (or ``None`` when ``optional``)."""
    return lambda name, value: check_int(name, value, minimum=1, optional=optional, hint=hint)


def int_or_auto(hint: str) -> Check:
    """An integer of at least 1, or ``"auto"`` (resolved at setup)."""
    return lambda name, value: value if value == "auto" else check_int(name, value, minimum=1, hint=hint)


def one_of(*choices: Any) -> Check:
    """One of ``choices`` (by type too: ``True`` is not ``1``)."""
    return lambda name, value: check_choice(name, value, choices)


def patterns(example: str) -> Check:
    """A list of module-name patterns, kept as a list (``[]`` for None)."""
    return lambda name, value: check_patterns(name, value, example=example)


def optional_str(what: str) -> Check:
    """None or a non-empty string or path."""

    def check(name: str, value: Any) -> Any:
        check_optional_str(name, value, what)
        return value

    return check


def check_patterns(name: str, patterns, *, example: str) -> list[str]:
    """A list of module-name patterns (a bare string would be read character by character), or ``[]`` for None."""
    if patterns is None:
        return []
    if (
        isinstance(patterns, str)
        or not isinstance(patterns, (list, tuple))
        or not all(isinstance(p, str) for p in patterns)
    ):
        raise ValueError(
            f"{name}={patterns!r} must be a list of module-name patterns (fnmatch, as in named_modules()), "
            f"e.g. {example}."
        )
    return list(patterns)


def check_optional_str(name: str, value, what: str) -> None:
    """``value`` is None or a non-empty string or path (a number would fail much later, inside a file open)."""
    if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value).strip()):
        raise ValueError(f"{name}={value!r} must be {what}, or None.")


def memory_size(name: str, value: Any) -> Any:
    """None, a positive number of bytes, or a size such as ``"80GB"``."""
    check_memory_size(name, value)
    return value


def blocks_override(name: str, value: Any) -> Any:
    """A list of block names kept as a tuple (the options are frozen and compared between Trainer calls)."""
    return tuple(value) if isinstance(value, list) else value


def fp8_recipe(name: str, value: Any) -> str | None:
    """The fp8 recipe's name (``True`` = "tensorwise"), or None when off; torchao must be installed."""
    return validate_fp8(value)


def pipeline_schedule(name: str, value: Any) -> str:
    """A schedule torch.distributed.pipelining has, at pp=1 too: a typo is a typo."""
    if value not in SCHEDULES:
        raise ValueError(f"{name}={value!r} is unknown; choose one of {sorted(SCHEDULES)}.")
    return value


def activation_checkpointing_mode(name: str, value: Any) -> str:
    """One of :data:`lightning_llm.parallel.activation_checkpointing.MODES`."""
    validate_options(value)
    return value


def activation_checkpointing_options(name: str, value: Any) -> ACOptions:
    """The options as :class:`~lightning_llm.parallel.activation_checkpointing.ACOptions` (from a dict, or the
    dataclass the CLI parses a config into); what a mode needs of them is checked with the mode."""
    return ACOptions.from_dict("none", value)


def context_parallel_method(name: str, value: Any) -> str:
    """One of context parallelism's methods (the check its ``apply_context_parallel`` runs)."""
    return check_method(value)


def tensor_parallel_plan(name: str, plan: Any) -> dict[str, str] | None:
    """A mapping of module-name patterns to known style names (styles checked here, patterns at setup)."""
    if plan is None:
        return None
    if not isinstance(plan, dict) or not all(isinstance(k, str) and k for k in plan):
        raise ValueError(
            f"{name}={plan!r} must map module-name patterns to styles, "
            "e.g. {'*.attn.c_attn': 'fused_qkv', '*.mlp.c_fc': 'colwise'}."
        )
    for pattern, style in plan.items():
        check_style(pattern, style)
    named = [p for p, s in plan.items() if s == "expert_parallel"]
    if named:
        raise ValueError(
            f"{name} gives {named} the style 'expert_parallel', which only expert_parallel_size sets. "
            "Use expert_parallel_size > 1 (and expert_parallel_plan to name a module), or the style 'experts'."
        )
    return plan


def expert_parallel_plan(name: str, plan: Any) -> dict[str, str] | None:
    """Module-name patterns to ``"expert_parallel"`` or ``"data_parallel"``, kept as a copy (None when empty)."""
    check_expert_parallel_plan(plan)
    return dict(plan) if plan else None


def pipeline_split(name: str, split: Any) -> list[list[str]] | None:
    """A list of stages, each a list of block names (``[["layers.0", "layers.1"], ["layers.2", "layers.3"]]``)."""
    if split is None:
        return None
    if (
        isinstance(split, str)
        or not isinstance(split, (list, tuple))
        or not all(isinstance(stage, (list, tuple)) and all(isinstance(n, str) for n in stage) for stage in split)
    ):
        raise ValueError(
            f"{name}={split!r} must be a list of stages, each a list of module names, "
            "e.g. [['layers.0', 'layers.1'], ['layers.2', 'layers.3']]."
        )
    return split
