"""The on-disk protocol of CheckpointRotation: commit markers, verification, safe deletion.

A checkpoint ``step=00000100.ckpt`` (a file, or a directory of shards) counts as complete only once
its marker ``step=00000100.ckpt.meta.json`` exists. The data is written under a temporary name,
renamed into place, and the marker is written last (temporary file + ``os.replace``), so a crash at
any point leaves either a complete checkpoint or leftovers that :func:`clean_incomplete` removes.
Deleting reverses the order: marker first, then data.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

MARKER_SUFFIX = ".meta.json"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"


def marker_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + MARKER_SUFFIX)


def write_json_atomically(path: Path, data: dict) -> None:
    """Write ``data`` so that readers see the old file, or the whole new one, never a part."""
    tmp = path.with_name(TMP_PREFIX + path.name)
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_marker(checkpoint: Path) -> dict | None:
    try:
        return json.loads(marker_path(checkpoint).read_text())
    except (OSError, ValueError):
        return None


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (by the step in their marker)."""
    found = []
    for marker in Path(directory).glob("*" + MARKER_SUFFIX):
        if marker.name.startswith((TMP_PREFIX, DELETING_PREFIX)):
            continue
        checkpoint = marker.with_name(marker.name[: -len(MARKER_SUFFIX)])
        meta = read_marker(checkpoint)
        if meta is not None and checkpoint.exists():
            found.append((meta.get("step", -1), meta.get("wall_time", 0), checkpoint))
    return [path for _, _, path in sorted(found)]


def verify(checkpoint: Path, trial_load: bool = False) -> None:
    """Check that every part of a checkpoint is there and readable; raise ``RuntimeError`` naming what is not."""
    if checkpoint.is_dir():
        _verify_sharded(checkpoint)
    elif not zipfile.is_zipfile(checkpoint) or zipfile.ZipFile(checkpoint).testzip() is not None:
        raise RuntimeError(f"Checkpoint {checkpoint} is not a readable torch archive.")
    if trial_load:
        import torch

        if checkpoint.is_dir():
            from lightning.fabric.utilities.load import _load_distributed_checkpoint

            _load_distributed_checkpoint(checkpoint)
        else:
            torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True)


def _verify_sharded(directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to read means the checkpoint is unusable
        raise RuntimeError(f"Sharded checkpoint {directory} has no readable .metadata: {err}") from err
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(f for f in files if not (directory / f).is_file())
    if missing:
        raise RuntimeError(f"Sharded checkpoint {directory} lacks shard files {missing}.")


def remove(checkpoint: Path) -> None:
    """Delete a checkpoint: marker first (it stops counting as complete), then its data."""
    marker_path(checkpoint).unlink(missing_ok=True)
    if not checkpoint.exists():
        return
    doomed = checkpoint.with_name(DELETING_PREFIX + checkpoint.name)
    os.replace(checkpoint, doomed)
    _remove_path(doomed)


def _remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_incomplete(directory: Path) -> list[Path]:
    """Remove what a crash left: temporary and half-deleted entries, and data without a marker."""
    removed = []
    for entry in Path(directory).iterdir():
        name = entry.name
        orphan = (
            not name.endswith(MARKER_SUFFIX) and not marker_path(entry).exists() and name.startswith("step=")
        )
        if name.startswith((TMP_PREFIX, DELETING_PREFIX)) or orphan:
            _remove_path(entry)
            removed.append(entry)
    return removed
