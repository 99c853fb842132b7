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


def fake_parameters(module: nn.Module, fn: Callable[[], Any], mode: FakeTensorMode | None = None) -> Any:
    """Call ``fn()`` under fake-tensor mode with every parameter of ``module`` replaced by a fake copy.

    Tensors ``fn`` makes from real data are converted on the fly; ``requires_grad`` is kept, so
    autograd records (and saved-tensor hooks see) what a real training forward would.

    Example::

        with FlopCounterMode() as counter:
            fake_parameters(model, lambda: model(tokens))
    """
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    named = dict(module.named_parameters())  # tied weights once; functional_call ties them again
    with mode:
        fake = {f"module.{n}": mode.from_tensor(p, static_shapes=True) for n, p in named.items()}
    for name, param in named.items():
        fake[f"module.{name}"].requires_grad_(param.requires_grad)
    with mode:
        return torch.func.functional_call(_Call(module, fn), fake, (), tie_weights=True, strict=False)
