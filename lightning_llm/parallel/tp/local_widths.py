"""Explain, on the first forward, a shape error that a width hard-coded in the model raises once TP splits heads.

A module whose projections tensor parallelism splits computes on ``1/tp`` of its heads: its q/k/v are
narrower on every rank and its head counts are divided (:mod:`.heads`). A forward that cuts or reshapes with
a width it stored or read from its input (nanoGPT's ``split(self.n_embd)``, ``view(B, T, C)`` with ``C``
the model width) then fails deep in the model's code with a bare ``not enough values to unpack`` or
``shape '[2, 8, 32]' is invalid``. :func:`explain_first_forward` hooks each such module (public
``always_call`` forward hooks, removed after its first forward): when that forward raises a shape error,
the hook adds a note to the exception (``BaseException.add_note``, printed with the traceback) naming the
module, its per-rank widths and head counts, the integer attributes still holding a whole width, and the fix.
The error itself is the model's own and is not replaced.
"""

from __future__ import annotations

import re
import sys

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_llm.parallel.tp.heads import HEAD_ATTRS

_SHAPE_ERROR = re.compile(
    r"unpack|shape|size|dimension|invalid for input|mat1 and mat2|must match|expected .* got", re.IGNORECASE
)
_NOTED = "_lightning_llm_width_note"


def _split_widths(module: nn.Module) -> list[tuple[str, str, int, int]]:
    """(child name, "out"/"in", local, global) for each parameter of ``module``'s children split along a width."""
    widths = []
    for name, child in module.named_modules():
        weight = getattr(child, "weight", None)
        if not name or not isinstance(weight, DTensor) or weight.dim() != 2:
            continue
        for placement in weight.placements:
            if isinstance(placement, Shard) and placement.dim in (0, 1):
                side = "out" if placement.dim == 0 else "in"
                widths.append((name, side, weight.to_local().shape[placement.dim], weight.shape[placement.dim]))
    return widths


def _whole_width_attrs(module: nn.Module, widths: list[tuple[str, str, int, int]]) -> dict[str, int]:
    whole = {g for _, _, local, g in widths if local != g}
    return {
        attr: value
        for attr, value in vars(module).items()
        if isinstance(value, int) and not isinstance(value, bool) and attr not in HEAD_ATTRS and value in whole
    }


def width_note(label: str, module: nn.Module, tp: int) -> str:
    """The note added to a shape error raised in ``module``'s first forward (see the module docstring)."""
    widths = _split_widths(module)
    parts = [f"{name} {'produces' if side == 'out' else 'reads'} {local} of {g}" for name, side, local, g in widths]
    heads = {a: v for a, v in vars(module).items() if a in HEAD_ATTRS and isinstance(v, int)}
    stale = _whole_width_attrs(module, widths)
    return (
        f"lightning_llm: this error was raised in the first forward of {label!r} ({type(module).__name__}) under "
        f"tensor_parallel_size={tp}, which splits its heads: on each rank "
        + (", ".join(parts) if parts else "its projections are narrower")
        + " features"
        + (f"; its head counts are per rank ({', '.join(f'{a}={v}' for a, v in heads.items())})" if heads else "")
        + ". A width written into the forward (split(self.n_embd), view(B, T, C) with C the model width) is wrong "
        "on every rank: cut with chunk(n, dim=-1), reshape with view(B, T, -1, head_dim) or the head count, and "
        "take widths from the tensors (q.size(-1)). "
        + (
            f"Attributes of this module still holding a whole width: {', '.join(f'{a}={v}' for a, v in stale.items())}."
            if stale
            else ""
        )
    ).rstrip()


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(text)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{text}", *exc.args[1:])


def _is_shape_error(exc: BaseException) -> bool:
    """A shape error of the model's own code, not yet explained (our refusals start with "Tensor parallelism:")."""
    if not isinstance(exc, (ValueError, RuntimeError, IndexError)) or getattr(exc, _NOTED, False):
        return False
    return bool(_SHAPE_ERROR.search(str(exc))) and not str(exc).startswith("Tensor parallelism:")


def explain_first_forward(module: nn.Module, label: str, tp: int) -> None:
    """Hook ``module``'s first forward: a shape error it raises gets :func:`width_note`; then the hook goes away.

    Example::

        explain_first_forward(model.transformer.h[0].attn, "transformer.h.0.attn", tp=2)
    """

    def after(mod, args, output) -> None:
        exc = sys.exc_info()[1]  # always_call hooks run inside the forward's `except` when it raised
        if output is None and exc is not None:
            if _is_shape_error(exc):
                _note(exc, width_note(label, mod, tp))
                setattr(exc, _NOTED, True)  # the innermost split module explains it; its parents stay quiet
            return
        handle.remove()

    handle = module.register_forward_hook(after, always_call=True)
