"""The on-disk protocol of CheckpointRotation: commit markers, verification, safe deletion, on any filesystem.

A checkpoint ``step=00000100.ckpt`` (a file, or a directory of shards) counts as complete only once
its marker ``step=00000100.ckpt.meta.json`` exists. The data is written (on a local disk under a
temporary name, then renamed into place), verified, and the marker is written last, so a crash at
any point leaves either a complete checkpoint or leftovers that :func:`clean_incomplete` removes.
Deleting reverses the order: marker first, then data. Every operation goes through fsspec
(:mod:`.fs`, which also says what "atomic" means on each kind of filesystem); checkpoints
are named by locations, strings that are local paths or URLs.

Three layouts are recognised: a single torch archive (single device, DDP), a
``torch.distributed.checkpoint`` directory (``.metadata`` plus shard files: LLMParallelStrategy,
ModelParallelStrategy) and a DeepSpeed directory (``latest`` naming a tag folder of per-rank files).
"""

from __future__ import annotations

import json
import re
import warnings
import zipfile

from lightning_llm._compat.torch_distributed import load_whole_checkpoint
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.fs import Location

MARKER_SUFFIX = ".meta.json"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
_DEEPSPEED_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


def marker_path(checkpoint: Location) -> str:
    return str(checkpoint) + MARKER_SUFFIX


def checkpoint_of(location: Location) -> str:
    """The checkpoint a location names: itself, or the checkpoint whose marker it is."""
    location = str(location)
    return location[: -len(MARKER_SUFFIX)] if location.endswith(MARKER_SUFFIX) else location


def write_json_atomically(path: Location, data: dict) -> None:
    """Write ``data`` so that readers see the old file, or the whole new one, never a part."""
    cfs.write_json(path, data)


def read_marker(checkpoint: Location, *, strict: bool = False) -> dict | None:
    """The commit marker of ``checkpoint``, or ``None`` where it has none.

    A marker that exists but does not parse (truncated, corrupted) is ``None`` too, unless ``strict``: then a
    ``RuntimeError`` names it, so a checkpoint whose marker was damaged is not taken for one that never had one.
    """
    path = marker_path(checkpoint)
    try:
        text = cfs.read_text(path)
    except OSError:
        return None
    try:
        return json.loads(text)
    except ValueError as err:
        if strict:
            raise RuntimeError(f"its commit marker {path} is not valid JSON ({err}): truncated or corrupted.") from None
        return None


def complete_checkpoints(directory: Location) -> list[str]:
    """Complete checkpoints in ``directory``, oldest first (by the save time in their marker, then step).

    Save time, not step: a run resumed from an older checkpoint starts a new timeline, and its saves
    are the newest even where the abandoned timeline reached higher steps.
    """
    found = []
    names = set(cfs.listdir(directory))
    for marker in names:
        if not marker.endswith(MARKER_SUFFIX) or marker.startswith((TMP_PREFIX, DELETING_PREFIX)):
            continue
        checkpoint = cfs.join(directory, marker[: -len(MARKER_SUFFIX)])
        try:
            meta = read_marker(checkpoint, strict=True)
        except RuntimeError as err:  # skipped, and said: an older checkpoint is what "last" will resume
            warnings.warn(f"Checkpoint {checkpoint} is skipped: {err}", stacklevel=2)
            continue
        if meta is not None and cfs.name(checkpoint) in names:
            found.append((meta.get("wall_time", 0), meta.get("step", -1), checkpoint))
    return [path for _, _, path in sorted(found)]


def verify(checkpoint: Location, trial_load: bool = False, world_size: int | None = None) -> None:
    """Check that every part of a checkpoint is there and readable; raise ``RuntimeError`` naming what is not.

    ``world_size`` is the number of ranks that saved it: a DeepSpeed checkpoint needs one file per rank.
    """
    if not cfs.exists(checkpoint):
        raise RuntimeError(f"Checkpoint {checkpoint} was not written.")
    if cfs.isfile(cfs.join(checkpoint, "latest")):
        parts = _verify_deepspeed(checkpoint, world_size)
    elif cfs.isdir(checkpoint):
        parts = _verify_sharded(checkpoint)
    else:
        _verify_archive(checkpoint)
        parts = [str(checkpoint)]
    if trial_load:
        _trial_load(checkpoint, parts)


def _verify_archive(path: Location) -> None:
    # torch.save writes a zip archive whose central directory comes last: reading it, and finding every
    # member's data inside the file, proves the write finished.
    try:
        with cfs.open_file(path) as f, zipfile.ZipFile(f) as archive:
            end = max((info.header_offset + info.compress_size for info in archive.infolist()), default=0)
    except (OSError, zipfile.BadZipFile) as err:
        raise RuntimeError(f"Checkpoint file {path} is not a readable torch archive ({err}).") from err
    if end > cfs.size(path):
        raise RuntimeError(f"Checkpoint file {path} is truncated: its members end at byte {end}.")


def _verify_sharded(directory: Location) -> list[str]:
    try:
        metadata = cfs.storage_reader(directory).read_metadata()
    except Exception as err:
        raise RuntimeError(f"Sharded checkpoint {directory} has no readable .metadata: {err}") from err
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(name for name in names if not cfs.isfile(cfs.join(directory, name)))
    if missing:
        raise RuntimeError(f"Sharded checkpoint {directory} lacks shard files {missing}.")
    # Lightning keeps the loops', callbacks' and data module's state beside the shards.
    meta = cfs.join(directory, "meta.pt")
    if not cfs.isfile(meta):
        raise RuntimeError(f"Sharded checkpoint {directory} lacks Lightning's meta.pt (trainer state).")
    _verify_archive(meta)
    return []


def _verify_deepspeed(directory: Location, world_size: int | None) -> list[str]:
    tag = cfs.read_text(cfs.join(directory, "latest")).strip()
    folder = cfs.join(directory, tag)
    parts = [cfs.join(folder, n) for n in cfs.listdir(folder) if n.endswith("_states.pt")]
    if not any(p.endswith("model_states.pt") for p in parts):
        raise RuntimeError(f"DeepSpeed checkpoint {directory} has no model states in {folder}.")
    ranks: dict[tuple[str, str], set[int]] = {}
    for part in parts:
        match = _DEEPSPEED_RANK_FILE.search(cfs.name(part))
        if match:
            ranks.setdefault((match[3], match[2]), set()).add(int(match[1]))
    for (kind, mp_rank), found in ranks.items():
        expected = set(range(world_size if world_size else max(found) + 1))
        if found != expected:
            raise RuntimeError(
                f"DeepSpeed checkpoint {directory} lacks {kind} states of ranks {sorted(expected - found)} "
                f"(model-parallel rank {mp_rank})."
            )
    for part in parts:
        _verify_archive(part)
    return parts


def _trial_load(checkpoint: Location, parts: list[str]) -> None:
    try:
        if parts:
            # DeepSpeed's own files, written by this run moments ago (trial_load is the commit's check of its own
            # write, never of a user's file); DeepSpeed's engine reads them with weights_only=False itself.
            for part in parts:
                cfs.torch_load(part, map_location="cpu", weights_only=False, mmap=True)
        else:
            load_sharded(checkpoint)
    except Exception as err:
        raise RuntimeError(f"Checkpoint {checkpoint} fails to load: {err}") from err


def load_sharded(checkpoint: Location) -> dict:
    """A whole sharded checkpoint in one process's memory (as Lightning's ``_load_distributed_checkpoint``), on any
    filesystem."""
    from lightning_llm.checkpointing.untrusted import bytes_checked, load_torch, refusals_unwrapped

    with refusals_unwrapped():
        state = load_whole_checkpoint(cfs.storage_reader(checkpoint), planner_mixin=bytes_checked(checkpoint))
    state.update(load_torch(cfs.join(checkpoint, "meta.pt")))
    return state


def fsync_tree(path: Location) -> None:
    """Flush a checkpoint file, or every file of a checkpoint directory, to stable storage (local disks)."""
    cfs.fsync_tree(path)


def remove(checkpoint: Location) -> None:
    """Delete a checkpoint: marker first (it stops counting as complete), then its data.

    On a local disk the data is first renamed aside (``.deleting-...``), so a crash mid-way leaves
    nothing that looks like a checkpoint; elsewhere it is deleted in place (without a marker it no
    longer counts, and :func:`clean_incomplete` finishes the job after a crash).
    """
    cfs.remove_tree(marker_path(checkpoint))
    if not cfs.exists(checkpoint):
        return
    if cfs.is_local(checkpoint):
        doomed = cfs.sibling(checkpoint, DELETING_PREFIX + cfs.name(checkpoint))
        cfs.replace(checkpoint, doomed)
        checkpoint = doomed
    cfs.remove_tree(checkpoint)


def clean_incomplete(directory: Location) -> list[str]:
    """Remove what a crash left: temporary and half-deleted entries, and checkpoint data without a marker."""
    removed = []
    names = set(cfs.listdir(directory))
    for entry in sorted(names):
        orphan = entry.startswith("step=") and not entry.endswith(MARKER_SUFFIX) and entry + MARKER_SUFFIX not in names
        if entry.startswith((TMP_PREFIX, DELETING_PREFIX)) or orphan:
            cfs.remove_tree(cfs.join(directory, entry))
            removed.append(cfs.join(directory, entry))
    return removed
