"""The on-disk protocol of CheckpointRotation: commit markers, verification, safe deletion.

A checkpoint ``step=00000100.ckpt`` (a file, or a directory of shards) counts as complete only once
its marker ``step=00000100.ckpt.meta.json`` exists. The data is written under a temporary name,
verified, renamed into place, and the marker is written last (temporary file + ``os.replace``), so
a crash at any point leaves either a complete checkpoint or leftovers that :func:`clean_incomplete`
removes. Deleting reverses the order: marker first, then data.

Three layouts are recognised: a single torch archive (single device, DDP), a
``torch.distributed.checkpoint`` directory (``.metadata`` plus shard files: LLMParallelStrategy,
ModelParallelStrategy) and a DeepSpeed directory (``latest`` naming a tag folder of per-rank files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path

MARKER_SUFFIX = ".meta.json"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
_DEEPSPEED_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


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
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make renames and deletions inside ``directory`` durable (a power cut cannot undo them)."""
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
    """Complete checkpoints in ``directory``, oldest first (by the save time in their marker, then step).

    Save time, not step: a run resumed from an older checkpoint starts a new timeline, and its saves
    are the newest even where the abandoned timeline reached higher steps.
    """
    found = []
    for marker in Path(directory).glob("*" + MARKER_SUFFIX):
        if marker.name.startswith((TMP_PREFIX, DELETING_PREFIX)):
            continue
        checkpoint = marker.with_name(marker.name[: -len(MARKER_SUFFIX)])
        meta = read_marker(checkpoint)
        if meta is not None and checkpoint.exists():
            found.append((meta.get("wall_time", 0), meta.get("step", -1), str(checkpoint)))
    return [Path(path) for _, _, path in sorted(found)]


def verify(checkpoint: Path, trial_load: bool = False, world_size: int | None = None) -> None:
    """Check that every part of a checkpoint is there and readable; raise ``RuntimeError`` naming what is not.

    ``world_size`` is the number of ranks that saved it: a DeepSpeed checkpoint needs one file per rank.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise RuntimeError(f"Checkpoint {checkpoint} was not written.")
    if (checkpoint / "latest").is_file():
        parts = _verify_deepspeed(checkpoint, world_size)
    elif checkpoint.is_dir():
        parts = _verify_sharded(checkpoint)
    else:
        _verify_archive(checkpoint)
        parts = [checkpoint]
    if trial_load:
        _trial_load(checkpoint, parts)


def _verify_archive(path: Path) -> None:
    # torch.save writes a zip archive whose central directory comes last: reading it, and finding every
    # member's data inside the file, proves the write finished.
    try:
        with zipfile.ZipFile(path) as archive:
            end = max((info.header_offset + info.compress_size for info in archive.infolist()), default=0)
    except (OSError, zipfile.BadZipFile) as err:
        raise RuntimeError(f"Checkpoint file {path} is not a readable torch archive ({err}).") from err
    if end > path.stat().st_size:
        raise RuntimeError(f"Checkpoint file {path} is truncated: its members end at byte {end}.")


def _verify_sharded(directory: Path) -> list[Path]:
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to read means the checkpoint is unusable
        raise RuntimeError(f"Sharded checkpoint {directory} has no readable .metadata: {err}") from err
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(name for name in names if not (directory / name).is_file())
    if missing:
        raise RuntimeError(f"Sharded checkpoint {directory} lacks shard files {missing}.")
    # Lightning keeps the loops', callbacks' and data module's state beside the shards.
    if not (directory / "meta.pt").is_file():
        raise RuntimeError(f"Sharded checkpoint {directory} lacks Lightning's meta.pt (trainer state).")
    _verify_archive(directory / "meta.pt")
    return []


def _verify_deepspeed(directory: Path, world_size: int | None) -> list[Path]:
    tag = (directory / "latest").read_text().strip()
    folder = directory / tag
    parts = sorted(folder.glob("*_states.pt")) if folder.is_dir() else []
    if not any(p.name.endswith("model_states.pt") for p in parts):
        raise RuntimeError(f"DeepSpeed checkpoint {directory} has no model states in {folder}.")
    ranks: dict[tuple[str, str], set[int]] = {}
    for part in parts:
        match = _DEEPSPEED_RANK_FILE.search(part.name)
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


def _trial_load(checkpoint: Path, parts: list[Path]) -> None:
    import torch

    try:
        if parts:
            for part in parts:
                torch.load(part, map_location="cpu", weights_only=False, mmap=True)
        else:
            from lightning.fabric.utilities.load import _load_distributed_checkpoint

            _load_distributed_checkpoint(checkpoint)
    except Exception as err:  # noqa: BLE001 - any failure to load means the checkpoint is unusable
        raise RuntimeError(f"Checkpoint {checkpoint} fails to load: {err}") from err


def fsync_tree(path: Path) -> None:
    """Flush a checkpoint file, or every file of a checkpoint directory, to stable storage."""
    for item in sorted(Path(path).rglob("*")) if Path(path).is_dir() else [Path(path)]:
        if item.is_file():
            fd = os.open(item, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def remove(checkpoint: Path) -> None:
    """Delete a checkpoint: marker first (it stops counting as complete), then its data."""
    marker_path(checkpoint).unlink(missing_ok=True)
    if not checkpoint.exists():
        return
    doomed = checkpoint.with_name(DELETING_PREFIX + checkpoint.name)
    os.replace(checkpoint, doomed)
    _remove_path(doomed)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_incomplete(directory: Path) -> list[Path]:
    """Remove what a crash left: temporary and half-deleted entries, and checkpoint data without a marker."""
    removed = []
    for entry in Path(directory).iterdir():
        name = entry.name
        orphan = name.startswith("step=") and not name.endswith(MARKER_SUFFIX) and not marker_path(entry).exists()
        if name.startswith((TMP_PREFIX, DELETING_PREFIX)) or orphan:
            _remove_path(entry)
            removed.append(entry)
    return removed
