"""Content checksums of a checkpoint's files, recorded in its commit marker and checked before resuming.

CRC-32 (``zlib.crc32``, the standard library, so no new dependency): it detects every error burst up to
32 bits and any other random corruption (flipped bytes, a zeroed block, a truncated or extended file)
with probability 1 - 2**-32, and is 3-4x faster than ``hashlib.blake2b`` (measured on a 100 MiB
checkpoint: 0.1-0.2 s against 0.43 s, torch.save itself 1.7 s, on a loaded 2-core machine). It is no
protection against deliberate tampering, which a training checkpoint need not resist.
The size of each file is recorded too, so truncation is found without reading anything. Files are read
through fsspec (:mod:`.fs`): on an object store, checking a checkpoint downloads it once.
"""

from __future__ import annotations

import zlib

from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.fs import Location

ALGORITHM = "crc32"
_CHUNK = 8 * 2**20


def file_crc32(path: Location) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits (read in 8 MiB chunks, from any filesystem)."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    local = cfs.is_local(path)
    with open(cfs.local_path(path), "rb", buffering=0) if local else cfs.open_file(path) as f:
        while size := f.readinto(buffer):  # one buffer reused: no allocation per chunk
            crc = zlib.crc32(view[:size], crc)
    return f"{crc:08x}"


def _member(checkpoint: Location, name: str) -> str:
    return str(checkpoint) if name == "." else cfs.join(checkpoint, name)


def compute(checkpoint: Location) -> dict[str, dict[str, int | str]]:
    """``{relative file name: {"size": bytes, "crc32": hex}}`` for a checkpoint file (name ".") or directory.

    Example::

        record = compute("checkpoints/step=00001000.ckpt")   # or "s3://bucket/ckpts/step=00001000.ckpt"
    """
    return {
        name: {"size": size, ALGORITHM: file_crc32(_member(checkpoint, name))}
        for name, size in sorted(cfs.files_under(checkpoint).items())
    }


def check(checkpoint: Location, recorded: dict[str, dict[str, int | str]]) -> None:
    """Raise ``RuntimeError`` naming the files of ``checkpoint`` whose content differs from ``recorded``.

    Files missing, of another size (truncated) or with another CRC-32 (corrupted) are reported; files
    that were not recorded are ignored (nothing reads them).
    """
    problems = []
    for name, record in sorted(recorded.items()):
        path = _member(checkpoint, name)
        if not cfs.isfile(path):
            problems.append(f"{name}: missing")
        elif (size := cfs.size(path)) != record["size"]:
            problems.append(f"{name}: {size} bytes, {record['size']} when saved (truncated or overwritten)")
        elif (crc := file_crc32(path)) != record[ALGORITHM]:
            problems.append(f"{name}: CRC-32 {crc}, {record[ALGORITHM]} when saved (content corrupted)")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more files" if len(problems) > 3 else "")
        raise RuntimeError(f"Checkpoint {checkpoint} does not match the checksums recorded when it was saved: {shown}.")


def verify_committed(checkpoint: Location) -> None:
    """Check a checkpoint that CheckpointRotation committed: structure, then every file's recorded checksum.

    Checkpoints without a marker (not written by CheckpointRotation) pass unchecked; a marker from
    before checksums were recorded gets the structural check only. Each committed checkpoint is read
    again on every call, never from a cache: ranks that resolve ``ckpt_path="last"`` each on their own
    must see the same bytes to pick the same checkpoint.
    Raises ``RuntimeError`` naming the checkpoint and what is wrong with it.
    """
    from lightning_llm.checkpointing import files

    meta = files.read_marker(checkpoint, strict=True)  # a damaged marker is refused, not taken for none
    if meta is None:
        return
    files.verify(checkpoint, world_size=meta.get("layout", {}).get("world_size"))
    if "checksums" in meta:
        check(checkpoint, meta["checksums"])


def refusal(checkpoint: Location) -> str | None:
    """Why ``checkpoint`` must not be resumed from (a message naming it and what to do), or ``None`` if it verifies."""
    try:
        verify_committed(checkpoint)
    except RuntimeError as err:
        return (
            f"ckpt_path={str(checkpoint)!r} cannot be resumed from: {err} Resume from an older checkpoint "
            "instead (ckpt_path='last' picks the newest one that verifies)."
        )
    return None
