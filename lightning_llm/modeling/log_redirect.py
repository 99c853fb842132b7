"""Redirect a LightningModule's ``self.log`` for the length of a call.

Two places run the user's ``training_step`` where its logging must not reach Lightning directly:
a measuring forward on fake tensors (its values are meaningless: dropped) and a pipeline stage
running one micro-batch (its values are recorded, averaged over micro-batches and logged once by
the strategy). Lightning has no public hook between ``self.log`` and its result collection, so the
instance attribute ``log`` is shadowed inside the context and removed afterwards (the class's
method is untouched). This is the only place the package does it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def redirected_log(module: nn.Module, sink: Callable[..., None] | None = None) -> Iterator[None]:
    """``module.log(name, value, ...)`` calls ``sink(name, value, ...)`` inside (``None``: drops them).

    Example::

        with redirected_log(lightning_module):   # a measuring forward logs nothing
            lightning_module.training_step(batch, 0)
    """
    had_own = "log" in vars(module)
    previous = vars(module).get("log")
    module.log = sink if sink is not None else (lambda *args, **kwargs: None)
    try:
        yield
    finally:
        if had_own:
            module.log = previous
        else:
            del module.log
