"""DCP's ``.metadata`` read without running code: an unpickler that builds DCP's metadata classes and nothing else.

torch's ``FileSystemReader.read_metadata`` unpickles the file without restriction, so a crafted ``.metadata`` in a
checkpoint handed over for resume or export would run its code. :func:`lightning_llm.checkpointing.fs.storage_reader`
calls :func:`unpickle_dcp_metadata` on the file before handing out any reader, so every DCP read of this package is covered.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

DCP_METADATA = ".metadata"
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# What torch 2.13's DCP pickles into `.metadata` besides its metadata module's own classes (and torch dtypes).
_DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch dtypes and sizes, and refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _DCP_METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as dcp_metadata

            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and found.__module__ == _DCP_METADATA_MODULE:
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's checkpoint metadata")


def unpickle_dcp_metadata(data: bytes, path: str) -> Any:
    """DCP's ``Metadata`` from the bytes of the ``.metadata`` file at ``path``, built from DCP's own classes only.

    Raises ``ValueError`` naming ``path`` when it holds anything else (or is not a pickle at all).
    """
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise ValueError(
            f"{path} is not DCP checkpoint metadata ({type(err).__name__}: {err}); it was not unpickled further, "
            "since it could run code. Pass a sharded checkpoint directory saved by LLMParallelStrategy (or "
            "torch.distributed.checkpoint), or restore its .metadata from the original."
        ) from err
