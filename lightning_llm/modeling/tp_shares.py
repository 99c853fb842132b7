"""Which share of each saved tensor one tensor-parallel rank holds, read from the dataflow of one forward.

Planning measures a model's activations on one process (:mod:`.activations`); under tensor parallelism a rank does
not hold ``1/tp`` of them. What it holds depends on where a tensor lies in the dataflow:

* **split**: inside a head-sharded region (the outputs of a column split up to the row split's input: q/k/v,
  attention, the MLP's hidden layer): ``1/tp`` per rank;
* **stream**: the residual stream between regions (norms, residual adds, the row split's output): whole on every rank,
  ``1/tp`` under sequence parallelism (sequence shards);
* **gathered**: what a column split keeps of its input for the weight's gradient: whole on every rank. Without
  sequence parallelism it is the stream tensor itself (counted once, however many splits read it); with it each split
  all-gathers its own whole copy of its sequence-sharded input (torch's ``ColwiseParallel(input_layouts=Shard(1))``),
  so it is counted once per split;
* **whole**: the output of a split whose output is gathered (the output head's logits): whole in both.

Tensors are classed by the module that makes them (inside a column split: split; inside a row split: stream; inside a
gathered split: whole) and elsewhere by their inputs (an op reading a split tensor makes a split one, else one reading
a whole tensor a whole one). Marks are kept by storage, weakly, and overwritten by every op's outputs, so a reused
storage never carries a stale mark and nothing is kept alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_llm._compat.torch import TorchDispatchMode, tree_leaves

SPLIT, WHOLE = "split", "whole"
ROLES = ("opens", "closes", "gathers")  # a column split, a row split, a column split whose output is gathered
_MADE_INSIDE = {"opens": SPLIT, "closes": None, "gathers": WHOLE}


def _ref(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


class TensorParallelShares:
    """Per-rank fractions of saved tensors under ``tp`` ranks (``sequence_parallel`` or not), for a model whose
    split modules are ``roles`` (module -> "opens" | "closes" | "gathers", from the tensor-parallel plan).

    Used by :class:`~lightning_llm.modeling.activation_tally.BlockTally`: :meth:`tracking` while the forward runs,
    :meth:`weigh` for each tensor autograd saves.

    Example::

        shares = TensorParallelShares(2, False, {layer.q_proj: "opens", layer.o_proj: "closes"})
        with shares.tracking():
            loss = model(tokens)        # saved tensors weighed with shares.weigh(t)
    """

    def __init__(self, tp: int, sequence_parallel: bool, roles: dict[nn.Module, str]) -> None:
        unknown = sorted({r for r in roles.values() if r not in ROLES})
        if unknown:
            raise ValueError(f"Unknown tensor-parallel roles {unknown}; expected one of {ROLES}.")
        self.tp, self.sequence_parallel, self.roles = tp, sequence_parallel, roles
        self._marks: dict[StorageWeakRef, str | None] = {}
        self._inside: list[tuple[nn.Module, str]] = []  # the role modules running, innermost last

    def mark_of(self, t: torch.Tensor) -> str | None:
        """SPLIT, WHOLE, or ``None`` for the stream."""
        return self._marks.get(_ref(t))

    def inside_split(self) -> bool:
        """Whether a split module is running (its ops do ``1/tp`` of the work)."""
        return bool(self._inside)

    def weigh(self, t: torch.Tensor, ref: StorageWeakRef) -> tuple[float, object]:
        """(this rank's fraction of ``t``, the key its bytes are counted once under) for a tensor autograd saves."""
        mark = self.mark_of(t)
        if mark == SPLIT:
            return 1 / self.tp, ref
        if mark == WHOLE:
            return 1.0, ref
        if self._inside and self._inside[-1][1] in ("opens", "gathers"):  # a column split's input: gathered
            return 1.0, (id(self._inside[-1][0]), ref) if self.sequence_parallel else ref
        return (1 / self.tp if self.sequence_parallel else 1.0), ref

    def fraction(self, t: torch.Tensor) -> float:
        """This rank's fraction of ``t`` as the stream or a region holds it (block inputs, op outputs)."""
        mark = self.mark_of(t)
        if mark == SPLIT:
            return 1 / self.tp
        return 1 / self.tp if mark is None and self.sequence_parallel else 1.0

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """While open, outputs of ops and of the role modules are marked (see the module doc)."""
        self._marks, self._inside = {}, []
        with ExitStack() as stack:
            for module, role in self.roles.items():
                pre = module.register_forward_pre_hook(lambda m, a, role=role: self._inside.append((m, role)))
                post = module.register_forward_hook(self._left, always_call=True)
                stack.callback(pre.remove)
                stack.callback(post.remove)
            stack.enter_context(_Marking(self._mark_outputs))
            yield

    def _left(self, module: nn.Module, args, output) -> None:
        _, role = self._inside.pop()
        self._set(output, _MADE_INSIDE[role])

    def _mark_outputs(self, args, out) -> None:
        inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        if self._inside:
            mark = _MADE_INSIDE[self._inside[-1][1]]
        else:
            marks = {self.mark_of(t) for t in inputs}
            mark = SPLIT if SPLIT in marks else WHOLE if WHOLE in marks else None
        self._set(out, mark, keep={_ref(t) for t in inputs})

    def _set(self, out, mark: str | None, keep: frozenset | set = frozenset()) -> None:
        """Mark ``out``'s storages, except those in ``keep``: a view or an in-place result is its input's storage
        and keeps its mark (a column split's reshape of its input stays on the stream)."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (ref := _ref(t)) not in keep:
                self._marks[ref] = mark


class _Marking(TorchDispatchMode):
    """Calls ``on_op(args, out)`` after every op."""

    def __init__(self, on_op: Callable) -> None:
        super().__init__()
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.on_op((args, kwargs), out)
        return out
