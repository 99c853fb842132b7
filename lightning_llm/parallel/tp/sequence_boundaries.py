"""Sequence parallelism around block parts whose layouts the residual stream does not expect.

Under sequence parallelism the residual stream between a block's parts is a sequence-sharded DTensor
(``Shard(1)``). A part whose tensor-parallel styles end in a plain tensor (a gathered column split, an
experts module's all-reduced output, a part kept whole) would hand the residual add a plain tensor
next to a DTensor, and a part kept whole (a state-space mixer under ``tensor_parallel_replicate``)
would multiply a DTensor activation by its plain weights. :func:`adapt_block_parts` puts a pair of
forward hooks on every direct part of each block:

* a part with no sharded parameter gets the whole sequence as a plain tensor (an all-gather), as
  torch's ``PrepareModuleInput`` does for a module that needs it;
* a plain output with the whole sequence goes back to ``Shard(1)`` (each rank keeps its slice, which
  is exact: every rank computed the same tensor), and a plain output with this rank's slice of the
  sequence is declared ``Shard(1)``.

Parts whose styles already hand back a ``Shard(1)`` DTensor (row-wise layers under SP) are untouched.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

SEQ_DIM = 1


def _is_sequence_sharded(x) -> bool:
    return isinstance(x, DTensor) and any(isinstance(p, Shard) and p.dim == SEQ_DIM for p in x.placements)


def _holds_shards(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


class _PartBoundary:
    """The hooks of one block part: gather its input if it is whole, put its output back on ``Shard(1)``."""

    def __init__(self, mesh: DeviceMesh, gather_input: bool) -> None:
        self.mesh, self.gather_input = mesh, gather_input
        self.seq_lens: list[tuple[int, int] | None] = []

    def before(self, module, args, kwargs):
        hidden = next((x for x in (*args, *kwargs.values()) if _is_sequence_sharded(x)), None)
        self.seq_lens.append(None if hidden is None else (hidden.shape[SEQ_DIM], hidden.to_local().shape[SEQ_DIM]))
        if hidden is None or not self.gather_input:
            return args, kwargs
        whole = lambda x: x.redistribute(self.mesh, [Replicate()]).to_local() if _is_sequence_sharded(x) else x  # noqa: E731
        return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

    def after(self, module, args, kwargs, output):
        lens = self.seq_lens.pop()
        if lens is None:
            return output
        if isinstance(output, tuple) and output:
            return (self._on_residual(output[0], lens), *output[1:])
        return self._on_residual(output, lens)

    def _on_residual(self, x, lens: tuple[int, int]):
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() <= SEQ_DIM:
            return x
        full, local = lens
        if x.shape[SEQ_DIM] == full:
            return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(self.mesh, [Shard(1)])
        if x.shape[SEQ_DIM] == local:
            return DTensor.from_local(x, self.mesh, [Shard(SEQ_DIM)], run_check=False)
        return x


def adapt_block_parts(blocks: list[nn.Module], mesh: DeviceMesh, skip: set[int]) -> int:
    """Hook every direct part of each block with parameters (modules in ``skip``, by id, excepted), or a block
    with no sharded parameter as a whole; return how many.

    ``skip`` holds the modules with a tensor-parallel style of their own (SP norms, projections written
    inline in a block's forward, gathered MoE blocks): their styles set their layouts.

    Example::

        adapt_block_parts(owned_blocks, tp_mesh, skip={id(m) for m in styled_modules})
    """
    count, skip = 0, set(skip)
    for block in blocks:
        # A block kept whole is one part: its insides see the whole sequence, as in one process.
        parts = block.children() if _holds_shards(block) else [block]
        for part in parts:
            if id(part) in skip or not any(True for _ in part.parameters()):
                continue
            skip.add(id(part))  # a part several blocks call is hooked once
            boundary = _PartBoundary(mesh, gather_input=not _holds_shards(part))
            part.register_forward_pre_hook(boundary.before, with_kwargs=True)
            part.register_forward_hook(boundary.after, with_kwargs=True)
            count += 1
    return count
