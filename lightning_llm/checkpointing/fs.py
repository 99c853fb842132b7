"""Where CheckpointRotation's files live: any fsspec filesystem (a local path, ``file://``, ``memory://``, ``s3://``...).

A *location* is a string: a local path, or a URL whose protocol names an fsspec filesystem (as in
Lightning's ``ModelCheckpoint``, through ``lightning.fabric.utilities.cloud_io.get_filesystem``).
Locations are joined as strings, so a URL keeps the form the user wrote (``memory://ckpts/step=...``).

What "atomic" means on each kind of filesystem:

* local disks (plain paths and ``file://`` URLs): a checkpoint is written under a temporary name,
  flushed to stable storage (``fsync``), and renamed into place (``os.replace``); the marker is
  written the same way. A reader, or a crash or power cut at any moment, sees the old state or the
  new one, never a part.
* every other filesystem (object stores, ``memory://``): there is no rename (a "move" copies and
  deletes), so the checkpoint is written straight under its final name and the marker, one object
  written in one request (``fs.pipe``; object stores make a single PUT visible whole or not at all),
  comes last. A checkpoint without its marker does not count and is removed at the next start.
  Durability is the store's: a write that returned is stored.

Example::

    fs, path = filesystem("memory://ckpts")          # (MemoryFileSystem, "/ckpts")
    join("memory://ckpts", "step=00000002.ckpt")     # "memory://ckpts/step=00000002.ckpt"
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from lightning_llm._compat.torch_distributed import fsspec_reader, fsspec_writer

Location = str | Path


def filesystem(location: Location) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem of ``location`` and the path on it (protocol stripped).

    Raises ``ValueError`` naming the location when its protocol is unknown or its filesystem's package is missing.
    """
    try:
        return fsspec.core.url_to_fs(str(location))
    except (ValueError, ImportError) as err:
        protocol = fsspec.utils.get_protocol(str(location))
        raise ValueError(
            f"Checkpoint location {str(location)!r}: fsspec cannot open protocol {protocol!r} ({err}). Use a local "
            f"path, or a URL of an installed fsspec filesystem (known protocols: file, memory, and s3/gs/az with "
            "s3fs/gcsfs/adlfs installed)."
        ) from err


def normalize(location: Location) -> str:
    """A location in the form CheckpointRotation keeps: local paths absolute (as Lightning's ModelCheckpoint keeps
    them), URLs as written. Raises ``ValueError`` naming a URL whose filesystem fsspec cannot open."""
    filesystem(location)
    return str(location) if "://" in str(location) else os.path.realpath(os.path.expanduser(str(location)))


def is_local(location: Location) -> bool:
    """Whether ``location`` is on a local disk (a plain path or a ``file://`` URL): renames there are atomic."""
    return isinstance(filesystem(location)[0], LocalFileSystem)


def local_path(location: Location) -> str:
    """A local ``location`` as a plain path (``file:///a/b`` -> ``/a/b``), for APIs that take only paths."""
    return filesystem(location)[1] if "://" in str(location) else str(location)


def _module(location: Location):
    return posixpath if "://" in str(location) else os.path


def join(location: Location, *names: str) -> str:
    """``location`` and names below it, joined in the location's own form (URL or path)."""
    return _module(location).join(str(location), *names)


def name(location: Location) -> str:
    """The last part of ``location`` (``step=00000002.ckpt``)."""
    return _module(location).basename(str(location).rstrip("/"))


def parent(location: Location) -> str:
    """The directory holding ``location``."""
    return _module(location).dirname(str(location).rstrip("/"))


def sibling(location: Location, new_name: str) -> str:
    """A location beside ``location`` in the same directory."""
    return join(parent(location), new_name)


def same(a: Location, b: Location) -> bool:
    """Whether two locations name the same entry (``file:///x`` and ``/x`` do; local paths are resolved)."""
    (fs_a, path_a), (fs_b, path_b) = filesystem(a), filesystem(b)
    if type(fs_a) is not type(fs_b):
        return False
    if isinstance(fs_a, LocalFileSystem):
        return Path(path_a).resolve() == Path(path_b).resolve()
    return path_a.rstrip("/") == path_b.rstrip("/")


def exists(location: Location) -> bool:
    """Whether ``location`` exists (a file or a directory)."""
    fs, path = filesystem(location)
    return fs.exists(path)


def isdir(location: Location) -> bool:
    """Whether ``location`` is a directory (on object stores: a prefix with objects below it)."""
    fs, path = filesystem(location)
    return fs.isdir(path)


def isfile(location: Location) -> bool:
    """Whether ``location`` is a file (an object)."""
    fs, path = filesystem(location)
    return fs.isfile(path)


def size(location: Location) -> int:
    """The size of the file ``location`` in bytes."""
    fs, path = filesystem(location)
    return fs.size(path)


def listdir(location: Location) -> list[str]:
    """Names of the entries directly in ``location`` (none if it does not exist)."""
    fs, path = filesystem(location)
    fs.invalidate_cache(path)  # other ranks and processes write here too: never answer from a listing cache
    try:
        return sorted(name(entry) for entry in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def files_under(location: Location) -> dict[str, int]:
    """``{relative name: size}`` of every file in a directory tree, or ``{".": size}`` for a single file."""
    fs, path = filesystem(location)
    fs.invalidate_cache(path)
    if not fs.isdir(path):
        return {".": fs.size(path)}
    root = path.rstrip("/") + "/"
    return {found[len(root) :]: info["size"] for found, info in fs.find(path, detail=True).items()}


def open_file(location: Location, mode: str = "rb") -> Any:
    """Open ``location`` through its filesystem (a context manager, seekable when reading)."""
    fs, path = filesystem(location)
    return fs.open(path, mode)


def read_text(location: Location) -> str:
    """The whole file ``location`` as text."""
    fs, path = filesystem(location)
    return fs.cat_file(path).decode()


def makedirs(location: Location) -> None:
    """Create the directory ``location`` and its parents (nothing to do on object stores)."""
    fs, path = filesystem(location)
    fs.makedirs(path, exist_ok=True)


def write_json(location: Location, data: dict) -> None:
    """Write ``data`` so that readers see the old file or the whole new one, never a part (see the module docstring)."""
    text = json.dumps(data, indent=1, default=str).encode()
    fs, path = filesystem(location)
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, text)  # one request: an object becomes visible whole
        return
    tmp = sibling(path, ".tmp-" + name(path))
    with open(tmp, "wb") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(parent(path))


def fsync_dir(location: Location) -> None:
    """Make renames and deletions inside a local directory durable (a power cut cannot undo them); elsewhere nothing."""
    if not is_local(location):
        return
    fd = os.open(local_path(location), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(location: Location) -> None:
    """Flush a local checkpoint file, or every file of a local checkpoint directory, to stable storage.

    Other filesystems store what a finished write sent; there is nothing to flush.
    """
    if not is_local(location):
        return
    path = Path(local_path(location))
    for item in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if item.is_file():
            fd = os.open(item, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def replace(source: Location, target: Location) -> None:
    """Rename ``source`` to ``target`` atomically: local disks only (``os.replace``), where :func:`is_local` holds."""
    os.replace(local_path(source), local_path(target))


def remove_tree(location: Location) -> None:
    """Delete a file or a directory tree; a missing one is not an error."""
    fs, path = filesystem(location)
    try:
        if fs.isdir(path):
            fs.rm(path, recursive=True)
        elif fs.exists(path):
            fs.rm_file(path)
    except FileNotFoundError:
        pass


def torch_save(obj: Any, location: Location) -> None:
    """``torch.save`` to any filesystem (serialized in memory, then written in one go)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    fs, path = filesystem(location)
    fs.pipe_file(path, buffer.getvalue())


def torch_load(location: Location, *, mmap: bool = False, **kwargs: Any) -> Any:
    """``torch.load`` from any filesystem; ``mmap=True`` memory-maps a file on a local disk (elsewhere it is read)."""
    import torch

    if is_local(location):
        return torch.load(local_path(location), mmap=mmap, **kwargs)
    with open_file(location) as f:
        return torch.load(f, **kwargs)


def storage_writer(location: Location) -> Any:
    """The ``torch.distributed.checkpoint`` writer for a checkpoint directory: the file writer on a local disk,
    torch's fsspec writer elsewhere (``checkpoint_id`` alone would write a URL into a local directory of that name)."""
    import torch.distributed.checkpoint as dcp

    if is_local(location):
        return dcp.FileSystemWriter(local_path(location))
    return fsspec_writer(str(location))


def storage_reader(location: Location) -> Any:
    """The ``torch.distributed.checkpoint`` reader matching :func:`storage_writer`, for a ``.metadata`` that holds
    DCP's metadata only: torch's reader unpickles it without restriction, so it is checked first
    (:func:`lightning_llm.checkpointing.dcp_metadata.unpickle_dcp_metadata`, ``ValueError`` naming the file)."""
    import torch.distributed.checkpoint as dcp

    from lightning_llm.checkpointing.dcp_metadata import DCP_METADATA, unpickle_dcp_metadata

    metadata = join(location, DCP_METADATA)
    if isfile(metadata):  # a missing one: the reader names it
        with open_file(metadata) as f:
            unpickle_dcp_metadata(f.read(), metadata)

    if is_local(location):
        return dcp.FileSystemReader(local_path(location))
    return fsspec_reader(str(location))
