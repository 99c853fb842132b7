"""Sharded checkpoints of LLMParallelStrategy with ``torch.distributed.checkpoint`` (DCP): save, async save, and
load (verified against the commit marker's checksums, strict both ways).

Optimizer state is saved in torch's "flattened" form, keyed by parameter name: Lightning's form keys
parameter groups by index, and pipeline stages have different groups under the same index, so a
sharded checkpoint could not tell them apart. Loading reshards by name, so the layout (tp, pp, ZeRO
degree, world size) may differ between save and load. Checkpoints go to any fsspec location: local
directories through DCP's file writer and reader, URLs of other filesystems through its fsspec ones
(:func:`lightning_llm.checkpointing.fs.storage_writer`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_llm._compat.lightning import METADATA_FILENAME, unwrap_optimizer
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.checksums import refusal
from lightning_llm.checkpointing.fs import Location
from lightning_llm.checkpointing.keys import few, matching_keys
from lightning_llm.checkpointing.staging import HostCopy, reusable_stager
from lightning_llm.checkpointing.untrusted import load_torch, refusals_unwrapped, safe_planner
from lightning_llm.checkpointing.write_gate import BACKGROUND_WRITES, background_writer, resume_background_writes
from lightning_llm.modeling.tied import differing, merged, refuse_untied, tied_groups

FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
MODEL_PREFIX = "state_dict."  # DCP flattens {"state_dict": {name: tensor}} to "state_dict.<name>"


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter name (hyperparameters included), this rank's shards."""
    optimizer = unwrap_optimizer(optimizer)  # Lightning's LightningOptimizer wraps the real one
    return get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER)


class AsyncSaver:
    """Writes sharded checkpoints in the background, one at a time; training waits only for the host copy.

    Every tensor is copied to host buffers reused from save to save (:mod:`.host_staging`), then
    written by a background thread whose collectives run on a gloo group of their own, so they cannot
    interleave with the training's collectives; :meth:`save` waits for the previous write before it
    overwrites the buffers. Rank 0 also writes the rest of Lightning's dict (loops, callbacks,
    hyper-parameters) to ``meta.pt`` after its shards; the returned future resolves after both.

    - On CPU the copy is :class:`HostCopy` (torch's stager spends ~5x the copy in Python per tensor
      there), and the whole write, DCP's planning included, waits behind :data:`BACKGROUND_WRITES`
      until training has resumed (:mod:`.write_gate`).
    - On CUDA the copy is DCP's ``async_save`` with torch's stager (pinned host buffers for the
      device-to-host copy, which dominates there).
    """

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._future: Future | None = None
        self._cuda = torch.cuda.is_available()
        self._stager = reusable_stager() if self._cuda else None
        self._shard_copy, self._rest_copy = HostCopy(), HostCopy()

    def save(self, checkpoint: dict[str, Any], path: Location, global_rank: int) -> Future:
        """Start writing ``checkpoint`` (Lightning's dict, with ``state_dict`` and ``optimizer_states``) to ``path``."""
        self.wait()
        state = _split(checkpoint, path)
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        writer = cfs.storage_writer(path)
        if self._cuda:
            shards = dcp.async_save(state, storage_writer=writer, process_group=self._group, async_stager=self._stager)
        else:
            shards = partial(dcp.save, self._shard_copy(state), storage_writer=writer, process_group=self._group)
        rest = self._rest_copy(checkpoint) if global_rank == 0 else None
        BACKGROUND_WRITES.hold()
        self._future = background_writer().submit(_finish, shards, rest, path)
        return self._future

    def wait(self) -> None:
        """Block until the last save is fully written on this rank."""
        if self._future is not None:
            future, self._future = self._future, None
            resume_background_writes()
            future.result()


def _finish(shards: Callable[[], Any] | Future, rest: dict[str, Any] | None, path: Location) -> Any:
    """The background part of a save: wait for training to resume, write (or wait for) the shards, then (rank 0)
    ``meta.pt``."""
    BACKGROUND_WRITES.wait()
    result = shards() if callable(shards) else shards.result()
    if rest is not None:
        cfs.torch_save(rest, cfs.join(path, METADATA_FILENAME))
    return result


def save(checkpoint: dict[str, Any], path: Location, global_rank: int) -> None:
    """Write ``checkpoint`` (Lightning's dict) to the directory ``path`` now: shards by DCP, the rest in ``meta.pt``
    (Lightning's layout, which its ``ModelParallelStrategy`` writes to local paths only)."""
    dcp.save(_split(checkpoint, path), storage_writer=cfs.storage_writer(path))
    if global_rank == 0:
        cfs.torch_save(checkpoint, cfs.join(path, METADATA_FILENAME))


def _split(checkpoint: dict[str, Any], path: Location) -> dict[str, Any]:
    # DCP writes the tensors; what is left in `checkpoint` (loops, callbacks, hyperparameters) goes to meta.pt.
    cfs.makedirs(path)
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return state


def refuse_unverified(strategy, path: Location) -> None:
    """Raise ``ValueError`` on every rank if a committed checkpoint's content fails its checksums (rank 0 reads it)."""
    error = strategy.broadcast(refusal(path) if strategy.global_rank == 0 else None)
    if error is not None:
        raise ValueError(error)


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """Name -> global shape of the model's state on every rank together (pipeline stages hold different parts)."""
    local = {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in get_model_state_dict(model).items()}
    if not dist.is_initialized():
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {name: shape for part in parts for name, shape in part.items()}


def sharded_shapes(path: Location) -> dict[str, tuple[int, ...] | None]:
    """Name -> global shape of the model tensors in a sharded checkpoint, read from its ``.metadata``."""
    metadata = cfs.storage_reader(path).read_metadata()
    return {
        key[len(MODEL_PREFIX) :]: tuple(entry.size) if hasattr(entry, "size") else None
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX)
    }


def file_state(path: Location, weights_only: bool | None = None) -> dict[str, Any]:
    """The model tensors of a full single-file checkpoint (memory-mapped on a local disk), read weights-only unless
    ``weights_only=False`` (``ValueError`` naming the file when it holds anything else, or no ``state_dict``)."""
    loaded = load_torch(path, mmap=True, weights_only=weights_only)
    state = loaded.get("state_dict") if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} holds no 'state_dict' entry, so it is not a Lightning checkpoint; pass a checkpoint saved by "
            "trainer.save_checkpoint, ModelCheckpoint or CheckpointRotation."
        )
    return state


def file_shapes(path: Location, weights_only: bool | None = None) -> dict[str, tuple[int, ...] | None]:
    """Name -> shape of the model tensors in a full single-file checkpoint (see :func:`file_state`)."""
    return {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in file_state(path, weights_only).items()}


def check_file(model: nn.Module, path: Location, strict: bool, weights_only: bool | None = None) -> None:
    """Refuse a full checkpoint file that holds more than tensors and plain values (read weights-only), one whose
    tensors do not match the model's both ways (when ``strict``), and one saved untied for a model that ties.
    A collective: every rank calls it."""
    state = file_state(path, weights_only)
    if strict:
        matching_keys(
            model_shapes(model),
            {k: tuple(v.shape) if torch.is_tensor(v) else None for k, v in state.items()},
            strict,
            str(path),
        )
    groups = merged(_on_any_rank([tied_groups(get_model_state_dict(model))]))
    refuse_untied(differing(groups, state), str(path))


def _on_any_rank(found: list) -> list:
    """What any rank found (every rank then raises alike); a rank whose shards are empty finds nothing itself."""
    if not dist.is_initialized():
        return found
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, found)
    return [item for part in parts for item in part]


def refuse_missing_optimizer_state(path: Location, key: str, request: dict[str, Any], saved) -> None:
    """Refuse a sharded checkpoint whose optimizer ``key`` holds no state for some of this optimizer's parameters
    (DCP would say only ``Missing key in checkpoint state_dict``), naming them and the way out."""
    missing = sorted({name.split(".", 1)[1].rsplit(".", 1)[0] for name in request if f"{key}.{name}" not in saved})
    if missing:
        raise ValueError(
            f"Checkpoint {path} holds no optimizer state for {few(missing)} of this model's parameters: the optimizer "
            "that saved it held other parameters (one tensor for tied weights, say, or another architecture). "
            "Resume with the model built as the run that saved it, or set `strict_loading = False` on the "
            "LightningModule to start those parameters' optimizer state afresh."
        )


def load(model: nn.Module, optimizers: list, path: Location, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` and ``optimizers`` (whatever layout saved it); returns the rest.

    ``optimizers`` is empty outside fitting (``trainer.test(ckpt_path=...)``), as Lightning restores optimizer state
    only to fit; a weights-only checkpoint given to fit is refused with Lightning's message.

    The names and global shapes of the model's tensors on every rank (all pipeline stages together) are
    compared with the checkpoint's both ways first (:func:`lightning_llm.checkpointing.keys.matching_keys`);
    with ``strict=False`` only the tensors both have with equal shapes are loaded, and their optimizer state.
    """
    if not cfs.isfile(cfs.join(path, ".metadata")):
        raise ValueError(
            f"The path {str(path)!r} does not point to a valid checkpoint: it is neither a checkpoint file nor a "
            "sharded checkpoint directory (no .metadata inside). "
            "Pass a checkpoint saved by LLMParallelStrategy, or load other weights into the model before fitting."
        )
    keep = matching_keys(model_shapes(model), sharded_shapes(path), strict, str(path))
    state = {k: v for k, v in get_model_state_dict(model).items() if k in keep}
    # Tied names read into tensors of their own, so the checkpoint's values can be compared before any is kept.
    groups = tied_groups(state)
    model_state = {"state_dict": {**state, **{n: torch.empty_like(state[n]) for g in groups for n in g[1:]}}}
    with refusals_unwrapped():
        dcp.load(model_state, storage_reader=cfs.storage_reader(path), planner=safe_planner(path))
    refuse_untied(_on_any_rank(differing(groups, model_state["state_dict"])), str(path))
    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
    saved = cfs.storage_reader(path).read_metadata().state_dict_metadata
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        if not any(name.startswith(key + ".") for name in saved):
            raise KeyError(
                f"Trying to restore optimizer state but checkpoint {path} contains only the model (no {key}). This "
                "is probably due to `ModelCheckpoint.save_weights_only` being set to `True`; fit from a checkpoint "
                "with optimizer state, or load the weights into the model before fitting."
            )
        full = optimizer_state(model, optimizer)
        # Flattened keys are "state.<param>.<field>" and "param_groups.<param>.<field>".
        request = {key: {k: v for k, v in full.items() if strict or k.split(".", 1)[1].rsplit(".", 1)[0] in keep}}
        if strict:
            refuse_missing_optimizer_state(path, key, request[key], saved)
        planner = safe_planner(path, allow_partial_load=not strict)
        with refusals_unwrapped():
            dcp.load(request, storage_reader=cfs.storage_reader(path), planner=planner)
        set_optimizer_state_dict(model, unwrap_optimizer(optimizer), {**full, **request[key]}, options=FLAT_OPTIMIZER)
    return load_torch(cfs.join(path, METADATA_FILENAME), weights_only=weights_only)
