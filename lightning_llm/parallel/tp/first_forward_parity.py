"""The first forward of each split part of a block: checked against the same part computed whole, and a shape error
in it explained.

Plans and first-forward watches read how a model uses its heads from names, shapes and the ops on the split
layers' outputs. What they cannot see is a value the model computes from the head count it finds on the rank: a
decay rate or an ALiBi slope per head built from ``query.shape[1]`` (yet-another-retnet's
``_build_decay_gammas(num_heads=...)``), which gives each rank the slopes of heads 0..h/tp instead of its own. Such
a split trains, and trains wrong.

So each part whose heads the plan splits (the smallest module holding a column split and the row split closing it:
the attention) is computed twice in the first forward: split, as the run does, and whole, on a copy of the part
made before the split with the live parameters gathered (``DTensor.full_tensor``) and the same inputs. A difference
beyond rounding stops the run before any optimizer step, naming the part and the entry that keeps it whole. The
first forward compared is the first with autograd on (a training step's). Parts
with active dropout are not compared (their random masks differ); the check costs one extra forward of one part per
block class, once.

A module whose projections tensor parallelism splits computes on ``1/tp`` of its heads: its q/k/v are narrower on
every rank and its head counts are divided (:mod:`.heads`). A forward that cuts or reshapes with a width it stored or
read from its input (nanoGPT's ``split(self.n_embd)``, ``view(B, T, C)`` with ``C`` the model width) then fails deep
in the model's code with a bare ``not enough values to unpack`` or ``shape '[2, 8, 32]' is invalid``.
:func:`explain_first_forward` hooks each such module (public ``always_call`` forward hooks, removed after its first
forward): when that forward raises a shape error, the hook adds a note to the exception (``BaseException.add_note``,
printed with the traceback) naming the module, its per-rank widths and head counts, the integer attributes still
holding a whole width, and the fix. The error itself is the model's own and is not replaced.
"""

from __future__ import annotations

import copy
import logging
import re
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_llm._compat.torch import outside_dispatch_modes, tree_leaves, without_hooks
from lightning_llm.parallel.tp.coverage import wildcard_index
from lightning_llm.parallel.tp.heads import HEAD_ATTRS

log = logging.getLogger(__name__)
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}  # relative norm of the difference; 16-bit: 2e-2
# (float64: 1e-6, since some models keep parts in float32 whatever the default dtype: Llama 4 its rotary tables)
CACHE_ARGUMENTS = frozenset({"past_key_values", "past_key_value", "layer_past", "kv_cache", "cache", "cache_params"})


def whole_copy(part: nn.Module) -> nn.Module | None:
    """A copy of ``part``, without hooks, taken before tensor parallelism changes it (its parameters' values are not
    used); ``None`` for a part that cannot be copied (its check is then skipped, with a line in the debug log)."""
    try:
        return without_hooks(copy.deepcopy(part))
    except Exception as error:  # an object inside the part that deepcopy refuses (a lock, a compiled kernel)
        log.debug("tensor parallel: %s cannot be copied, so its first forward is not compared: %s", type(part), error)
        return None


def check_first_forward(part: nn.Module, whole: nn.Module, label: str) -> None:
    """Compare ``part``'s first split forward with ``whole`` (its copy from :func:`whole_copy`) on the same inputs.

    Example::

        whole = whole_copy(layer.self_attn)
        ...  # split layer.self_attn
        check_first_forward(layer.self_attn, whole, "model.layers.0.self_attn")
    """
    if whole is None or any(isinstance(m, nn.Dropout) and m.p > 0 for m in whole.modules()):
        log.debug("tensor parallel: %s is not compared with the whole part (no copy, or dropout)", label)
        return
    handles, inputs = [], []

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        # A training forward only: a pipeline stage's first call learns its output shapes on placeholder inputs.
        if torch.is_grad_enabled():
            inputs.append((args, dict(kwargs)))  # before the split's own hooks cut them (ALiBi rows per rank)

    def compare(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not inputs:
            return
        for handle in handles:
            handle.remove()
        # Unseen by activation checkpointing (no autograd, no dispatch mode): what it saved or cached of the check's
        # ops would be replayed by the recompute as the block's own.
        with torch.no_grad(), outside_dispatch_modes():
            try:
                expected = _whole_output(module, whole, *inputs[0])
            except Exception as error:  # the copy cannot run on these inputs: the check is skipped, said in the log
                log.debug("tensor parallel: %s is not compared with the whole part: %s", label, error)
                return
            _raise_if_apart(label, _first_tensor(output), expected)

    handles.append(part.register_forward_pre_hook(keep, with_kwargs=True, prepend=True))
    handles.append(part.register_forward_hook(compare, with_kwargs=True))


def _whole_output(live: nn.Module, whole: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """``whole`` run with ``live``'s gathered parameters and buffers on the gathered inputs. A KV cache
    passed in is left out: the live call has already appended its own (split) keys to it, and in a training forward
    the cache starts empty, so the part's output does not depend on it."""
    state = {n: _full(t).detach() for n, t in [*live.named_parameters(), *live.named_buffers()]}
    args = tuple(None if _is_cache(v) else v for v in args)
    kwargs = {k: None if _is_cache(v) or k in CACHE_ARGUMENTS else v for k, v in kwargs.items()}
    out = torch.func.functional_call(whole, state, _gathered(args), _gathered(kwargs), strict=False)
    return _first_tensor(out)


def _is_cache(value) -> bool:
    return type(value).__name__.endswith("Cache")


def _gathered(value):
    if isinstance(value, DTensor):
        return value.full_tensor().detach()
    if isinstance(value, tuple):
        return tuple(_gathered(v) for v in value)
    if isinstance(value, list):
        return [_gathered(v) for v in value]
    if isinstance(value, dict):
        return {k: _gathered(v) for k, v in value.items()}
    return value.detach() if isinstance(value, torch.Tensor) else value


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _first_tensor(output) -> torch.Tensor | None:
    first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
    return _full(first).detach() if first is not None else None


def _raise_if_apart(label: str, got: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    if got is None or expected is None or got.shape != expected.shape:
        return  # a part returning no tensor, or another shape: the watches and the parity tests cover it
    tolerance = TOLERANCE.get(got.dtype, 2e-2)
    difference = ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()
    if difference > tolerance:
        raise RuntimeError(
            f"Tensor parallelism: {label}, split by heads, computes something else than the same part whole in its "
            f"first forward (relative difference {difference:.2e}, more than rounding allows, {tolerance:.0e}): the "
            "model derives a per-head value from the head count it finds on each rank (decay rates or ALiBi "
            "slopes built from the local heads), or keeps a head count the split did not divide. Keep it whole: "
            f"tensor_parallel_replicate=['{wildcard_index(label)}'], or use ZeRO or pipeline parallelism."
        )


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
