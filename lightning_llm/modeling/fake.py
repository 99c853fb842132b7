"""Running code on a model whose parameters are fake tensors: shapes and dtypes only, nothing allocated.

FLOP counting and activation measurement both need one forward of a model that may be too large
to allocate (or lives on the meta device). ``torch.func.functional_call`` swaps the parameters for
fake copies for one call, tied weights staying tied; a small wrapper module lets that call be any
function (a ``training_step``, not only ``forward``). ``FakeTensorMode`` is a private torch module:
it is used here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_llm._compat.torch import FakeTensorMode


class _Call(nn.Module):
    """Holds ``module`` as a submodule so that ``functional_call`` can swap its parameters around ``fn()``."""

    def __init__(self, module: nn.Module, fn: Callable[[], Any]) -> None:
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self) -> Any:
        return self.fn()


def fake_parameters(
    module: nn.Module, fn: Callable[[], Any], mode: FakeTensorMode | None = None, device: torch.device | None = None
) -> Any:
    """Call ``fn()`` under fake-tensor mode with every parameter of ``module`` replaced by a fake copy.

    Tensors ``fn`` makes from real data are converted on the fly; ``requires_grad`` is kept, so
    autograd records (and saved-tensor hooks see) what a real training forward would.

    ``device`` is where ``fn``'s real tensors live (the batch's device). A module built on the meta device
    (LLMParallelStrategy builds it there, then materializes each rank's shards) has its parameters, and its
    meta buffers, faked on ``device`` instead: a fake meta weight meeting a fake CPU batch is a device
    mismatch. ``None`` keeps every tensor's own device.

    Example::

        with FlopCounterMode() as counter:
            fake_parameters(model, lambda: model(tokens), device=tokens.device)
    """
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    named = dict(module.named_parameters())  # tied weights once; functional_call ties them again
    buffers = {n: b for n, b in module.named_buffers() if b.is_meta and device is not None}
    with mode:
        fake = {f"module.{n}": _fake(mode, t, device) for n, t in {**named, **buffers}.items()}
    for name, param in named.items():
        fake[f"module.{name}"].requires_grad_(param.requires_grad)
    with _scrubbed(module, mode.is_our_fake), mode:
        return torch.func.functional_call(_Call(module, fn), fake, (), tie_weights=True, strict=False)


def meta_parameters(module: nn.Module, fn: Callable[[], Any]) -> Any:
    """Call ``fn()`` with every parameter and buffer of ``module`` on the meta device (``requires_grad`` kept).

    For reading what a forward calls, not its values: nothing is allocated, and tensors a forward caches (in a
    module attribute, a shared cache object, or a module-level ``lru_cache`` keyed by device, as yet-another-retnet's
    decay masks are) are meta tensors the real run, on its own device, never mistakes for its own. ``fn``'s inputs
    must be on the meta device too. Example::

        meta_parameters(model, lambda: model(tokens.to("meta")))
    """
    named = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    meta = {f"module.{n}": t.detach().to("meta").requires_grad_(t.requires_grad) for n, t in named.items()}
    meta.update({f"module.{n}": t.to("meta") for n, t in buffers.items()})
    known = _tensor_ids(module)
    with _scrubbed(module, lambda value: isinstance(value, torch.Tensor) and value.is_meta and id(value) not in known):
        return torch.func.functional_call(_Call(module, fn), meta, (), tie_weights=True, strict=False)


_SLOTS = ("_parameters", "_buffers", "_modules")
_TENSOR_SLOTS = ("_parameters", "_buffers")


@contextmanager
def _scrubbed(module: nn.Module, is_ours: Callable[[Any], bool]) -> Iterator[None]:
    """Leave the model, after the block, as it was before: a forward that caches what it computes (OLMo-core's rotary
    tables in a shared ``BufferCache``, its model's ``_device`` read off the first parameter) would hand the call's
    tensors and devices to the real run. Every module attribute the call set or replaced gets its old value back
    (or goes), and the ``is_ours`` tensors it put in mappings, lists and objects the modules hold are dropped, to be
    computed again. Parameters and buffers are put back too: ``functional_call`` leaves the swapped-in tensors on
    a module reached under two names (one attention module called from every block)."""
    before = {id(m): dict(vars(m)) for m in module.modules()}
    tensors = {id(m): {slot: dict(getattr(m, slot)) for slot in _TENSOR_SLOTS} for m in module.modules()}
    try:
        yield
    finally:
        seen: set[int] = set()
        for m in module.modules():
            for slot in _TENSOR_SLOTS:
                getattr(m, slot).update(tensors.get(id(m), {}).get(slot, {}))
            state, old = vars(m), before.get(id(m), {})
            for key in [k for k in state if k not in _SLOTS]:
                if key not in old:
                    del state[key]
                elif state[key] is not old[key]:
                    state[key] = old[key]
                else:
                    _drop(state[key], is_ours, seen, depth=3)


def _drop(value: Any, is_ours: Callable[[Any], bool], seen: set[int], depth: int) -> None:
    """Delete the ``is_ours`` tensors held in ``value``'s mappings, lists and plain attributes, ``depth`` levels down."""
    for container, key, item in _held(value, seen, depth):
        if is_ours(item):
            del container[key]


def _held(value: Any, seen: set[int], depth: int) -> list[tuple[Any, Any, Any]]:
    """(container, key, item) for what ``value``'s mappings, lists and plain attributes hold, ``depth`` levels down;
    deepest first, so deleting by key or index keeps the rest valid."""
    if depth < 0 or id(value) in seen or isinstance(value, (nn.Module, torch.Tensor, str, bytes, int, float, type)):
        return []
    seen.add(id(value))
    if isinstance(value, MutableMapping):
        entries = list(value.items())
    elif isinstance(value, list):
        entries = list(reversed(list(enumerate(value))))
    elif hasattr(value, "__dict__"):
        return _held(vars(value), seen, depth - 1)
    else:
        return []
    found = []
    for key, item in entries:
        found += _held(item, seen, depth - 1)
        found.append((value, key, item))
    return found


def _tensor_ids(module: nn.Module) -> set[int]:
    """Ids of the tensors the model's modules hold outside their parameter and buffer slots."""
    ids: set[int] = set()
    seen: set[int] = set()
    for m in module.modules():
        for key, value in vars(m).items():
            if key not in _SLOTS:
                ids.add(id(value))
                ids.update(id(item) for _, _, item in _held(value, seen, depth=3))
    return ids


def _fake(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A fake copy of ``tensor`` (called inside ``mode``): on ``device`` where ``tensor`` is on the meta device."""
    if device is None or not tensor.is_meta or torch.device(device).type == "meta":
        return mode.from_tensor(tensor, static_shapes=True)
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
