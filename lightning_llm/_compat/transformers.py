"""Private Hugging Face transformers attributes: init marks, tensor-parallel plans, the attention implementation.

transformers is optional: nothing is imported here.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning_llm._compat.registry import Private, register

CHECKED = "transformers 5.24"


def clear_hf_initialized(obj: Any) -> None:
    """Clear the ``_is_hf_initialized`` mark Hugging Face leaves on modules/tensors it has initialized or loaded
    (``init_weights`` skips marked ones); a model built on the meta device may carry the marks from construction.
    No public API resets them. Checked on transformers 5.24."""
    if getattr(obj, "_is_hf_initialized", False):
        obj._is_hf_initialized = False


def is_pretrained_model(module: Any) -> bool:
    """Whether ``module`` is a Hugging Face ``PreTrainedModel``, without loading transformers' modeling code.

    ``transformers.PreTrainedModel`` is a lazy attribute: reading it imports ``modeling_utils`` and with it every
    quantizer (torchao's prints "Failed to load ..." for each CUDA kernel on a CPU machine). A model of that class
    exists only once ``transformers.modeling_utils`` is loaded, so its absence answers the question."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def tp_plan(module: Any) -> Any:
    """A Hugging Face model's ``_tp_plan`` (module pattern -> style name), or ``None``; the class attribute
    ``PreTrainedModel`` fills from the config's ``base_model_tp_plan``, which has no public getter. Checked on
    transformers 5.24."""
    return getattr(module, "_tp_plan", None)


def _check():
    import inspect

    try:
        from transformers import PreTrainedModel, modeling_utils
    except ImportError:
        return "skipped: transformers is not installed"
    if "_is_hf_initialized" not in inspect.getsource(modeling_utils):
        raise AttributeError("transformers no longer uses _is_hf_initialized")
    if not hasattr(PreTrainedModel, "_tp_plan") and "_tp_plan" not in inspect.getsource(modeling_utils):
        raise AttributeError("transformers no longer has PreTrainedModel._tp_plan")


register(
    Private(
        name="transformers `_is_hf_initialized`, `PreTrainedModel._tp_plan`",
        upstream="transformers",
        accessor="transformers.clear_hf_initialized, tp_plan",
        used_by=("parallel/init/entry.py", "parallel/tp/style_kinds.py"),
        why="re-run HF's `init_weights` on a meta-built model; read HF's own TP plan. No public API for either",
        caught_by="`tests/hf/` TP-plan and init tests",
        checked=CHECKED,
        check=_check,
    )
)


def attention_implementation(model: Any) -> str | None:
    """The attention function a Hugging Face model calls (``config._attn_implementation``: "sdpa", "eager", or a
    name registered with ``AttentionInterface``), or ``None`` for a model without one. ``set_attn_implementation``
    is public but has no public getter; context parallelism reads it back to confirm the switch to its function.
    Checked on transformers 5.24."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _check_attention_implementation():
    try:
        from transformers import LlamaConfig
    except ImportError:
        return "skipped: transformers is not installed"
    if LlamaConfig(attn_implementation="sdpa")._attn_implementation != "sdpa":
        raise AttributeError("PretrainedConfig._attn_implementation no longer reports the attention implementation")
    return None


register(
    Private(
        name="transformers `PretrainedConfig._attn_implementation`",
        upstream="transformers",
        accessor="transformers.attention_implementation",
        used_by=("parallel/cp/interception.py",),
        why="confirm that `set_attn_implementation` switched a model to context parallelism's registered attention "
        "function (it only warns when a model cannot switch); no public getter",
        caught_by="`tests/strategies/test_context_parallel_parity.py`",
        checked=CHECKED,
        check=_check_attention_implementation,
    )
)
