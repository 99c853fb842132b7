"""The checks of LLMParallelStrategy's arguments that span several of them (layout, expert and context parallelism,
patterns, options a mode ignores), called by :func:`~lightning_llm.strategies.parallel_options.build_options`.

Each refuses an impossible value before any process starts, naming the value and the fix.
"""

from __future__ import annotations

import os

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_llm.parallel.activation_checkpointing import ACOptions
from lightning_llm.parallel.data_parallel import FSDP2_ZERO_STAGES
from lightning_llm.parallel.ep.apply import check_plan as check_expert_parallel_plan
from lightning_llm.parallel.tp.plan import check_style
from lightning_llm.validation import check_bool, check_choice, check_int, check_memory_size


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


def check_tensor_parallel_plan(plan) -> None:
    """A mapping of module-name patterns to known style names (styles checked here, patterns at setup)."""
    if plan is None:
        return
    if not isinstance(plan, dict) or not all(isinstance(k, str) and k for k in plan):
        raise ValueError(
            f"tensor_parallel_plan={plan!r} must map module-name patterns to styles, "
            "e.g. {'*.attn.c_attn': 'fused_qkv', '*.mlp.c_fc': 'colwise'}."
        )
    for pattern, style in plan.items():
        check_style(pattern, style)
    named = [p for p, s in plan.items() if s == "expert_parallel"]
    if named:
        raise ValueError(
            f"tensor_parallel_plan gives {named} the style 'expert_parallel', which only expert_parallel_size sets. "
            "Use expert_parallel_size > 1 (and expert_parallel_plan to name a module), or the style 'experts'."
        )


def check_pipeline_split(split) -> None:
    """A list of stages, each a list of block names (``[["layers.0", "layers.1"], ["layers.2", "layers.3"]]``)."""
    if split is None:
        return
    if (
        isinstance(split, str)
        or not isinstance(split, (list, tuple))
        or not all(isinstance(stage, (list, tuple)) and all(isinstance(n, str) for n in stage) for stage in split)
    ):
        raise ValueError(
            f"pipeline_split={split!r} must be a list of stages, each a list of module names, "
            "e.g. [['layers.0', 'layers.1'], ['layers.2', 'layers.3']]."
        )


def check_optional_str(name: str, value, what: str) -> None:
    """``value`` is None or a non-empty string or path (a number would fail much later, inside a file open)."""
    if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value).strip()):
        raise ValueError(f"{name}={value!r} must be {what}, or None.")


def warn_unused(pp, num_microbatches, virtual_stages, pipeline_split, activation_checkpointing, ac_options) -> None:
    """Options that the chosen mode ignores, said once instead of dropped silently."""
    ignored = [
        f"{name}={value!r}"
        for name, value in (
            ("num_microbatches", num_microbatches),
            ("virtual_stages", virtual_stages),
            ("pipeline_split", pipeline_split),
        )
        if value is not None
    ]
    if pp == 1 and ignored:
        rank_zero_warn(f"{', '.join(ignored)} ignored: pipeline_parallel_size=1 runs no pipeline.")
    if isinstance(ac_options, ACOptions):  # the CLI parses a config's options into the dataclass
        defaults = ACOptions()
        given = {k: v for k, v in vars(ac_options).items() if v != getattr(defaults, k)}
    else:
        given = dict(ac_options or {})
    if activation_checkpointing in ("none", "full") and given:
        rank_zero_warn(
            f"activation_checkpointing_options={given!r} ignored: activation_checkpointing="
            f"{activation_checkpointing!r} takes none of them (they apply to 'selective' and 'auto')."
        )


def check_layout(tp, pp, dp, replicate, zero_stage, sequence_parallel, num_microbatches, virtual_stages, device_memory):
    """Refuse an impossible layout (sizes, ZeRO stage, sequence parallelism, micro-batches)."""
    if tp != "auto":  # "auto": Lightning's ModelParallelStrategy meaning, the devices of a node (resolved at setup)
        check_int("tensor_parallel_size", tp, minimum=1, hint="or 'auto' for every device of a node")
    check_int("pipeline_parallel_size", pp, minimum=1, hint="1 turns pipeline parallelism off")
    if dp != "auto":
        check_int("data_parallel_size", dp, minimum=1, hint="or 'auto' for world size / (tp * pp)")
    check_int("data_parallel_replicate_size", replicate, minimum=1)
    check_bool("sequence_parallel", sequence_parallel)
    check_int("num_microbatches", num_microbatches, minimum=1, optional=True)
    check_int("virtual_stages", virtual_stages, minimum=1, optional=True)
    check_memory_size("device_memory", device_memory)
    check_choice("zero_stage", zero_stage, (*FSDP2_ZERO_STAGES, "auto"))
    if zero_stage == 0 and replicate > 1:
        raise ValueError(
            "data_parallel_replicate_size > 1 (HSDP) needs zero_stage 2 or 3; zero_stage=0 already replicates everywhere."
        )
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tensor_parallel_size > 1 (it shards along the TP group).")


def check_expert_parallel(ep, plan, dp, cp) -> None:
    """Refuse an expert-parallel size that cannot work (the experts' count is checked on the model at setup)."""
    check_int("expert_parallel_size", ep, minimum=1, hint="1 turns expert parallelism off")
    check_expert_parallel_plan(plan)
    if ep > 1 and cp != 1:
        raise ValueError(
            f"expert_parallel_size={ep} with context_parallel_size={cp} is not supported yet: the experts' groups "
            "are carved from the data-parallel ranks, which context parallelism also divides. Use one of the two."
        )
    if ep > 1 and dp != "auto" and dp % ep:
        raise ValueError(
            f"expert_parallel_size={ep} does not divide data_parallel_size={dp}: the expert-parallel groups are "
            f"carved out of the data-parallel ranks. Use an expert_parallel_size that divides {dp}."
        )


def check_context_parallel(cp, method, *, compile_blocks) -> None:
    """Refuse a context-parallel size or method that is impossible, or a combination not built yet (named)."""
    check_int("context_parallel_size", cp, minimum=1, hint="1 turns context parallelism off")
    check_choice("context_parallel_method", method, ("ring", "ulysses"))
    if cp > 1 and compile_blocks:
        raise ValueError(
            f"context_parallel_size={cp} with compile_blocks={compile_blocks!r} is not supported yet (the attention "
            "redirection, block hooks and a function mode, is untested inside compiled blocks). Use "
            "compile_blocks=False with context parallelism."
        )
