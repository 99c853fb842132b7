"""Reading checkpoint files a user hands over (to resume or to export) without running code from them.

Unpickling runs whatever the bytes say (``__reduce__`` may name ``os.system``), so a downloaded or
tampered checkpoint must never be read with a full unpickler. Every read of a checkpoint goes through here:

* torch archives (a ``.ckpt`` file, Lightning's ``meta.pt`` beside DCP shards) with torch's weights-only
  unpickler (:func:`load_torch`): tensors, plain values and the package's own types registered with
  ``torch.serialization.add_safe_globals`` (:class:`~lightning_llm.models.llama.LlamaConfig`);
* DCP's ``.metadata``, a plain pickle, with an unpickler that builds DCP's metadata classes and nothing else
  (:mod:`.dcp_metadata`, run by :func:`lightning_llm.checkpointing.fs.storage_reader` before torch's
  reader unpickles the same bytes);
* DCP's byte entries (non-tensor values inside the shards, which torch's planner loads with
  ``weights_only=False``) through :class:`WeightsOnlyBytes`, which unpickles them weights-only first.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner

from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.dcp_metadata import DCP_METADATA, unpickle_dcp_metadata
from lightning_llm.checkpointing.fs import Location

# What torch.load raises on a file it refuses or cannot read: an object outside the weights-only set, a file that is
# not a torch archive (or is truncated), a legacy pickle that mmap cannot map.
LOAD_ERRORS = (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, AttributeError, ImportError)


def load_torch(location: Location, *, mmap: bool = False, weights_only: bool | None = None) -> Any:
    """``torch.load`` of a user's checkpoint file, weights-only; ``ValueError`` naming the file when refused.

    ``weights_only=False`` (passed on by ``trainer.fit(..., weights_only=False)``) is the caller's explicit
    statement that the file is trusted; ``None`` means weights-only.

    Example::

        checkpoint = load_torch("runs/step=1000.ckpt", mmap=True)
    """
    trusted = weights_only is False
    try:
        return cfs.torch_load(location, map_location="cpu", mmap=mmap, weights_only=not trusted)
    except LOAD_ERRORS as err:
        raise ValueError(refusal(location, err)) from err


def refusal(location: Location, err: BaseException) -> str:
    """Why ``location`` was not loaded, and what to do: an object outside the weights-only set, or not an archive."""
    text = str(err)
    if "Weights only load failed" in text or "Unsupported global" in text:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        what = f"it names {found.group(1)}" if found else text.splitlines()[0]
        return (
            f"{location} holds a pickled object that is not a tensor or a plain value ({what}); it was not loaded, "
            "since unpickling it could run code. Load only checkpoints you trust; if this one is yours, register "
            "that class with torch.serialization.add_safe_globals([...]) (or resume with "
            "trainer.fit(..., weights_only=False)), or re-save the checkpoint without that object."
        )
    return (
        f"{location} is not a readable torch checkpoint ({type(err).__name__}: {text.splitlines()[0] if text else ''}); "
        "pass a .ckpt file written by trainer.save_checkpoint, or a sharded checkpoint directory."
    )


def read_dcp_metadata(checkpoint: Location) -> Any:
    """A sharded checkpoint's ``.metadata`` (DCP's ``Metadata``), built from DCP's own classes only (``ValueError``
    naming the file for anything else)."""
    path = cfs.join(checkpoint, DCP_METADATA)
    with cfs.open_file(path) as f:
        return unpickle_dcp_metadata(f.read(), path)


class WeightsOnlyBytes:
    """Mixin for DCP load planners: a byte entry (a non-tensor value DCP stored with ``torch.save``) is
    unpickled weights-only, then handed on re-serialized, so torch's own ``weights_only=False`` load of it
    builds only what the weights-only load allowed.

    Example::

        dcp.load(state, storage_reader=cfs.storage_reader(path), planner=safe_planner(path))
    """

    source: str = "the checkpoint"

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except LOAD_ERRORS as err:
            raise ValueError(refusal(f"{self.source} (entry {read_item.dest_index.fqn!r})", err)) from err
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)  # type: ignore[misc]


class _SafeLoadPlanner(WeightsOnlyBytes, DefaultLoadPlanner):
    pass


def bytes_checked(checkpoint: Location) -> type[WeightsOnlyBytes]:
    """:class:`WeightsOnlyBytes` naming ``checkpoint`` in its refusals (a mixin for DCP's other planners)."""
    return type("WeightsOnlyBytes", (WeightsOnlyBytes,), {"source": str(checkpoint)})


@contextmanager
def refusals_unwrapped() -> Iterator[None]:
    """Re-raise a refusal of this module that DCP wrapped in its ``CheckpointException`` (a traceback per rank)
    as the ``ValueError`` itself, whose message names the file and the fix."""
    try:
        yield
    except CheckpointException as err:
        failures = [f[0] if isinstance(f, tuple) else f for f in getattr(err, "failures", {}).values()]
        refused = next((f for f in failures if isinstance(f, ValueError)), None)
        if refused is None:
            raise
        raise ValueError(str(refused)) from err


def safe_planner(checkpoint: Location, **kwargs: Any) -> DefaultLoadPlanner:
    """DCP's ``DefaultLoadPlanner(**kwargs)`` with byte entries unpickled weights-only (:class:`WeightsOnlyBytes`)."""
    planner = _SafeLoadPlanner(**kwargs)
    planner.source = str(checkpoint)
    return planner
