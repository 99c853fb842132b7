"""Host copies of a checkpoint's tensors in buffers that are reused from one save to the next.

An asynchronous save stalls training only while the state is copied to host memory. Copying into
fresh allocations each time also pays for the allocation and, on first touch, the page faults of
every byte (on CPU about as long as the copy itself). torch's ``DefaultStager`` keeps one host
storage per source storage (a weak-keyed cache), so from the second save on the stall is the copy
alone. The host buffers stay allocated between saves: one extra host copy of what this rank saves,
as in torchtitan's async checkpointing. On CUDA the buffers are pinned, so the device-to-host copy
runs at full PCIe/NVLink-C2C speed.

A cached buffer may be overwritten only after the write that reads it has finished: both users
(single-file writes and DCP's ``async_save``) wait for the previous save before staging the next.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def reusable_stager() -> DefaultStager:
    """A synchronous stager whose host buffers persist across saves (pinned on CUDA).

    Example::

        stager = reusable_stager()
        dcp.async_save(state, checkpoint_id=path, async_stager=stager)   # the next save reuses its buffers
    """
    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=False))


class HostCopy:
    """Copies the tensors of any collection (Lightning's checkpoint dict) to reused host buffers.

    Only tensors are copied; other values are not (containers are rebuilt around them), as in
    Lightning's own ``AsyncCheckpointIO``: a deep copy of hyper-parameters or callback state could
    fail on objects that cannot be copied, and training does not modify them.

    Example::

        copy = HostCopy()
        staged = copy(checkpoint)   # safe to write in a thread while training goes on
    """

    def __init__(self) -> None:
        self._stager = reusable_stager()

    def __call__(self, collection: Any) -> Any:
        tensors: list[torch.Tensor] = []
        _tensors(collection, tensors)
        return _replaced(collection, iter(self._stager.stage(tensors)))


# Dicts, lists and tuples only (what Lightning's checkpoint holds): Lightning's apply_to_collection also
# walks dataclasses and named tuples, and costs ~10 ms per pass over a checkpoint of a few hundred tensors.
def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj.detach())
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out)


def _replaced(obj: Any, staged: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return next(staged)
    if isinstance(obj, dict):
        items = [(key, _replaced(value, staged)) for key, value in obj.items()]
        return type(obj)(items) if type(obj) in (dict, OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple)):
        values = [_replaced(value, staged) for value in obj]
        return values if isinstance(obj, list) else tuple(values) if type(obj) is tuple else type(obj)(*values)
    return obj
