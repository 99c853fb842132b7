"""Which function initializes a model's weights: the model's own, found the way a user would expect.

A model built on the meta device has no values; after sharding, each rank allocates its shards
and must fill them exactly as the model would have filled itself. The model's own entry point
wins over per-leaf defaults, because that is where its recipe lives (GPT-2-style std 0.02,
depth-scaled residual projections, tied embeddings):

1. a Hugging Face ``PreTrainedModel``: its public ``init_weights()`` (runs ``_init_weights`` on
   every module through ``initialize_weights`` and re-ties the weights);
2. any other module with an ``init_weights()`` or ``reset_parameters()`` method (``Llama``,
   torchtitan-style models, and torch's own leaf layers ``nn.Linear`` / ``nn.Embedding`` / norms).

The search is top-down: the outermost module with an entry point owns its whole subtree, so a
root ``reset_parameters()`` is called once and the leaves' defaults never overwrite it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_llm._compat.transformers import clear_hf_initialized, is_pretrained_model


def _entry_point(module: nn.Module) -> Callable[[], None] | None:
    if is_pretrained_model(module):
        return _hf_init(module)
    for name in ("init_weights", "reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _hf_init(model) -> Callable[[], None]:
    def init() -> None:
        # Hugging Face marks what it has initialized (or loaded) and skips it afterwards; a model
        # built on the meta device may carry those marks from construction, so they are cleared.
        for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
            clear_hf_initialized(obj)
        model.init_weights()

    return init


def is_meta(tensor: torch.Tensor) -> bool:
    """The default test of :func:`init_entry_points`: a tensor built on the meta device holds no values yet."""
    return tensor.is_meta


def _has_pending(module: nn.Module, recurse: bool, pending: Callable[[torch.Tensor], bool]) -> bool:
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return any(pending(t) for t in tensors)


def init_entry_points(
    module: nn.Module, pending: Callable[[torch.Tensor], bool] = is_meta, strict: bool = True
) -> list[tuple[str, Callable[[], None]]]:
    """The (module name, init function) pairs that together initialize every pending parameter and buffer of ``module``.

    ``pending`` says which tensors still need the model's init: by default those on the meta device;
    ``LLMDeepSpeedStrategy`` passes "partitioned by ``deepspeed.zero.Init``". Subtrees with no pending
    tensors (built eagerly, already holding values) are left alone.

    With ``strict`` (the default), raises ``RuntimeError`` naming the modules whose tensors no entry point
    covers: on meta they would keep uninitialized memory, which trains silently wrong. ``strict=False``
    skips them (tensors that already hold their construction values).

    Example::

        for name, init in init_entry_points(lightning_module):
            init()
    """
    found: list[tuple[str, Callable[[], None]]] = []
    covered: list[str] = []
    uncovered: list[str] = []
    for name, child in module.named_modules():
        if any(name == c or name.startswith(c + ".") or c == "" for c in covered) or not _has_pending(
            child, True, pending
        ):
            continue
        entry = _entry_point(child)
        if entry is not None:
            found.append((name, entry))
            covered.append(name)
        elif _has_pending(child, False, pending):
            uncovered.append(name or type(child).__name__)
    if uncovered and strict:
        raise RuntimeError(
            f"Modules {uncovered} own parameters or buffers but neither they nor a parent define init_weights() or "
            "reset_parameters(); after building on the meta device they would hold uninitialized memory. Add a "
            "reset_parameters() that fills them (or build the model outside configure_model to keep eager init)."
        )
    return found
