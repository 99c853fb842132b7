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

A shape error in a split part's first forward gets a note (:func:`explain_first_forward`; what it says, and the
stored widths tried before it comes to that: :mod:`.first_forward_widths`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm._compat.torch import outside_dispatch_modes, tree_leaves, without_hooks
from lightning_llm.parallel.tp.coverage import wildcard_index

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


def check_first_forward(part: nn.Module, whole: nn.Module, label: str, before: Callable | None = None) -> None:
    """Compare ``part``'s first split forward with ``whole`` (its copy from :func:`whole_copy`) on the same inputs.

    ``before(part, whole, args, kwargs)`` runs once first, on the inputs of the part's first training or evaluation
    forward (:mod:`.first_forward_widths` gives stored whole widths this rank's there).

    Example::

        whole = whole_copy(layer.self_attn)
        ...  # split layer.self_attn
        check_first_forward(layer.self_attn, whole, "model.layers.0.self_attn")
    """
    if whole is None:
        log.debug("tensor parallel: %s is not compared with the whole part (it could not be copied)", label)
        return
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in whole.modules())  # random masks differ: no compare
    handles, inputs, ran_before = [], [], []

    def keep(module: nn.Module, args: tuple, kwargs: dict) -> None:
        # ``before`` at the first forward on real data: a training one, or an evaluation (Lightning's sanity check
        # runs validation first), not a pipeline stage's first call, which learns its output shapes on placeholder
        # inputs in training mode without autograd.
        if before is not None and not ran_before and (torch.is_grad_enabled() or not module.training):
            ran_before.append(True)
            before(module, whole, args, kwargs)
        # The comparison: a training forward only.
        if torch.is_grad_enabled():
            inputs.append((args, dict(kwargs)))  # before the split's own hooks cut them (ALiBi rows per rank)
            if dropout:
                for handle in handles:
                    handle.remove()

    def compare(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not inputs:
            return
        for handle in handles:
            handle.remove()
        # Unseen by activation checkpointing (no autograd, no dispatch mode): what it saved or cached of the check's
        # ops would be replayed by the recompute as the block's own.
        with torch.no_grad(), outside_dispatch_modes():
            try:
                expected = whole_output(module, whole, *inputs[0])
            except Exception as error:  # the copy cannot run on these inputs: the check is skipped, said in the log
                log.debug("tensor parallel: %s is not compared with the whole part: %s", label, error)
                return
            _raise_if_apart(label, first_tensor(output), expected)

    handles.append(part.register_forward_pre_hook(keep, with_kwargs=True, prepend=True))
    handles.append(part.register_forward_hook(compare, with_kwargs=True))


@contextlib.contextmanager
def aside(module: nn.Module):
    """Compute with ``module`` beside the run: no autograd, unseen by dispatch modes, dropout off."""
    training = module.training
    try:
        with torch.no_grad(), outside_dispatch_modes():
            yield module.eval()
    finally:
        module.train(training)


def _difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def close(got: torch.Tensor, expected: torch.Tensor | None) -> bool:
    return expected is not None and got.shape == expected.shape and _difference(got, expected) <= _tolerance(got)


def _tolerance(t: torch.Tensor) -> float:
    return TOLERANCE.get(t.dtype, 2e-2)


def whole_output(live: nn.Module, whole: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """``whole`` run with ``live``'s gathered parameters and buffers on the gathered inputs. A KV cache
    passed in is left out: the live call has already appended its own (split) keys to it, and in a training forward
    the cache starts empty, so the part's output does not depend on it."""
    state = {n: _full(t).detach() for n, t in [*live.named_parameters(), *live.named_buffers()]}
    args, kwargs = without_caches(args, kwargs)
    out = torch.func.functional_call(whole, state, _gathered(args), _gathered(kwargs), strict=False)
    return first_tensor(out)


def without_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    args = tuple(None if _is_cache(v) else v for v in args)
    return args, {k: None if _is_cache(v) or k in CACHE_ARGUMENTS else v for k, v in kwargs.items()}


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


def first_tensor(output) -> torch.Tensor | None:
    first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
    return _full(first).detach() if first is not None else None


def _raise_if_apart(label: str, got: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    if got is None or expected is None or got.shape != expected.shape:
        return  # a part returning no tensor, or another shape: the watches and the parity tests cover it
    tolerance, difference = _tolerance(got), _difference(got, expected)
    if difference > tolerance:
        raise RuntimeError(
            f"Tensor parallelism: {label}, split by heads, computes something else than the same part whole in its "
            f"first forward (relative difference {difference:.2e}, more than rounding allows, {tolerance:.0e}): the "
            "model derives a per-head value from the head count it finds on each rank (decay rates or ALiBi "
            "slopes built from the local heads), or keeps a head count the split did not divide. Keep it whole: "
            f"tensor_parallel_replicate=['{wildcard_index(label)}'], or use ZeRO or pipeline parallelism."
        )


SHAPE_ERROR = re.compile(
    r"unpack|shape|size|dimension|invalid for input|mat1 and mat2|must match|expected .* got", re.IGNORECASE
)
NOTED = "_lightning_llm_width_note"


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(text)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{text}", *exc.args[1:])


def _is_shape_error(exc: BaseException) -> bool:
    """A shape error of the model's own code, not yet explained (our refusals start with "Tensor parallelism:")."""
    if not isinstance(exc, (ValueError, RuntimeError, IndexError)) or getattr(exc, NOTED, False):
        return False
    return bool(SHAPE_ERROR.search(str(exc))) and not str(exc).startswith("Tensor parallelism:")


def explain_first_forward(module: nn.Module, note: Callable[[nn.Module], str]) -> None:
    """Hook ``module``'s first forward: a shape error it raises gets ``note(module)`` added (the model's error is not
    replaced; :func:`.first_forward_widths.width_note` says which widths); then the hook goes away.

    Example::

        explain_first_forward(attn, partial(width_note, "transformer.h.0.attn", tp=2))
    """

    def after(mod, args, output) -> None:
        exc = sys.exc_info()[1]  # always_call hooks run inside the forward's `except` when it raised
        if output is None and exc is not None:
            if _is_shape_error(exc):
                _note(exc, note(mod))
                setattr(exc, NOTED, True)  # the innermost split module explains it; its parents stay quiet
            return
        handle.remove()

    handle = module.register_forward_hook(after, always_call=True)
