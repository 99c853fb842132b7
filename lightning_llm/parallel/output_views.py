"""Check what FSDP2's "returned a view tensor" warning warns about, instead of printing it on every rank.

Under tensor parallelism a model's logits come out of ``DTensor.to_local()`` (the head's gathered output),
which is a view. FSDP2 registers its pre-backward hook on the root module's outputs and warns, on every
rank, that an in-place op on a view (``logits += bias``, ``logits.div_(t)``) would silently drop that
hook: backward could fail or produce wrong gradients. Most models never modify their logits in place, so
the warning is noise for them and too weak for the rest. :class:`OutputViewGuard` checks the actual
condition: it registers a gradient hook of its own beside FSDP's on each view output (an in-place op
drops both), and after the backward raises, naming the module, if no output of the step's forwards saw
its gradient. With the check in place the warning is filtered.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_llm._compat.known_warnings import ScopedFilters

VIEW_WARNING = r".*FSDP2-wrapped module .* returned a view tensor.*"


class OutputViewGuard:
    """Watches the view outputs of FSDP root modules; :meth:`check` after each backward.

    Example::

        guard = OutputViewGuard([model.model])
        loss = step(batch)
        loss.backward()
        guard.check()  # RuntimeError if the logits were modified in place before the backward
    """

    def __init__(self, roots: list[nn.Module]) -> None:
        self._pending: list[tuple[str, list[bool]]] = []
        for root in roots:
            root.register_forward_hook(self._record)
        self._filters = ScopedFilters()
        self.silence()

    def silence(self) -> None:
        """Filter FSDP2's warning until :meth:`close`: ``check`` tests its condition on every rank instead."""
        self._filters.remove()
        self._filters.ignore(VIEW_WARNING)

    def _record(self, module: nn.Module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and output._is_view():
            seen = [False]
            output.register_hook(lambda grad: seen.__setitem__(0, True))
            self._pending = [*self._pending[-63:], (type(module).__name__, seen)]  # bounded: a backward may never come

    def check(self) -> None:
        """Raise if the step's forwards returned views and the backward reached none of them (see the module doc)."""
        pending, self._pending = self._pending, []
        if pending and not any(seen[0] for _, seen in pending):
            raise RuntimeError(
                f"The output of {pending[0][0]} (the model's logits, a view under tensor parallelism) was modified "
                "in place before the backward (e.g. `logits += bias`, `logits.div_(t)`, `logits[mask] = 0`). That "
                "drops FSDP2's pre-backward hook on it, which can leave gradients wrong. Use out-of-place ops "
                "(`logits = logits + bias`) or `.clone()` the output before modifying it."
            )

    def close(self) -> None:
        """Show FSDP2's warning again (the strategy's teardown); a later fit of the same model calls :meth:`silence`."""
        self._filters.remove()
