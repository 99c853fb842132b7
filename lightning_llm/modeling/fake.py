"""Running code on a model whose parameters are fake tensors: shapes and dtypes only, nothing allocated.

FLOP counting and activation measurement both need one forward of a model that may be too large
to allocate (or lives on the meta device). ``torch.func.functional_call`` swaps the parameters for
fake copies for one call, tied weights staying tied; a small wrapper module lets that call be any
function (a ``training_step``, not only ``forward``). ``FakeTensorMode`` is a private torch module:
it is used here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
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
    with mode:
        return torch.func.functional_call(_Call(module, fn), fake, (), tie_weights=True, strict=False)


def _fake(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A fake copy of ``tensor`` (called inside ``mode``): on ``device`` where ``tensor`` is on the meta device."""
    if device is None or not tensor.is_meta or torch.device(device).type == "meta":
        return mode.from_tensor(tensor, static_shapes=True)
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
