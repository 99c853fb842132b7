"""Widths in the first forward of a head-split part: a stored whole width given this rank's where that is what runs,
and a shape error explained otherwise.

A module whose projections tensor parallelism splits computes on ``1/tp`` of its heads: its q/k/v are narrower on
every rank and its head counts are divided (:mod:`.heads`). A forward that cuts or reshapes with a width it stored or
read from its input (nanoGPT's ``split(self.n_embd)``, ``view(B, T, C)`` with ``C`` the model width) then fails deep
in the model's code with a bare ``not enough values to unpack`` or ``shape '[2, 8, 32]' is invalid``.
:func:`.first_forward_parity.explain_first_forward` hooks each such module (public ``always_call`` forward hooks, removed after its first
forward): when that forward raises a shape error, the hook adds a note to the exception (``BaseException.add_note``,
printed with the traceback) naming the module, its per-rank widths and head counts, the integer attributes still
holding a whole width, and the fix. The error itself is the model's own and is not replaced.

Before that, where such an attribute is there to blame (XGLM's attention reshapes its merged heads to
``self.embed_dim``), :func:`localize_whole_widths` tries this rank's width in it, and keeps it only where the part
then runs and computes what it computes whole.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_llm.parallel.tp.first_forward_parity import (
    SHAPE_ERROR,
    aside,
    close,
    first_tensor,
    whole_output,
    without_caches,
)
from lightning_llm.parallel.tp.heads import HEAD_ATTRS

log = logging.getLogger(__name__)


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


def localize_whole_widths(
    part: nn.Module, whole: nn.Module, args: tuple, kwargs: dict, label: str, siblings: tuple[nn.Module, ...] = ()
) -> dict[str, int]:
    """Give ``part`` this rank's width in its attributes that still hold a whole one, where that is what makes it
    run; return the attributes changed.

    XGLM's attention reshapes its merged heads to ``self.embed_dim``: split by heads, that width is this rank's
    share. Which attributes the forward reads cannot be seen, and an integer equal to a split layer's width may be
    something else (CodeGen's ``embed_dim // mp_num`` groups must stay whole), so nothing is guessed: a part split
    by heads (it keeps a head count) that holds such an attribute is run once on the first forward's inputs (no
    autograd, outside dispatch modes, dropout off); only when that fails is each such attribute, or all of them,
    given its per-rank width, kept where the part then runs and computes what ``whole`` computes on the gathered
    parameters (:data:`.first_forward_parity.TOLERANCE`). Otherwise nothing changes and the forward raises its own
    error, explained by :func:`width_note`. (An MLP's ``intermediate_size`` is not read in its forward: parts
    without heads are not run aside.)
    """
    widths = _split_widths(part)
    stale = _whole_width_attrs(part, widths)
    local = {g: n for _, _, n, g in widths if n != g}
    heads = any(isinstance(getattr(part, a, None), int) for a in HEAD_ATTRS)
    if not (stale and heads) or not _is_width_error(_dry_run(part, args, kwargs)):
        return {}
    for attrs in [list(stale), *([a] for a in stale if len(stale) > 1)]:
        for attr in attrs:
            setattr(part, attr, local[stale[attr]])
        got = _dry_run(part, args, kwargs)
        if isinstance(got, torch.Tensor) and close(got, _eval_whole(part, whole, args, kwargs)):
            changed = {a: local[stale[a]] for a in attrs}
            for sibling in siblings:
                for attr, value in changed.items():
                    if getattr(sibling, attr, None) == stale[attr]:
                        setattr(sibling, attr, value)
            log.info("tensor parallel: %s (and its kind in every block) reads this rank's width: %s", label, changed)
            return changed
        for attr in attrs:
            setattr(part, attr, stale[attr])
    return {}


def _dry_run(part: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | BaseException | None:
    """``part``'s first output tensor on these inputs, computed aside (caches left out); the error if it raises."""
    try:
        with aside(part):
            args, kwargs = without_caches(args, kwargs)
            return first_tensor(part(*args, **kwargs))
    except (ValueError, RuntimeError, IndexError, TypeError) as error:
        return error


def _is_width_error(result) -> bool:
    return isinstance(result, BaseException) and bool(SHAPE_ERROR.search(str(result)))


def _eval_whole(part: nn.Module, whole: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    try:
        with aside(whole):
            return whole_output(part, whole, args, kwargs)
    except Exception as error:  # the copy cannot run on these inputs: nothing to check against
        log.debug("tensor parallel: the whole copy of %s cannot run: %s", type(part).__name__, error)
        return None
