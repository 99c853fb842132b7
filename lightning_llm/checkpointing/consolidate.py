"""Read any Lightning checkpoint of lightning_llm as full tensors, and write it as one file plain torch can load.

A checkpoint saved by LLMParallelStrategy is a directory: one shard file per rank, DCP's
``.metadata`` and Lightning's own ``meta.pt`` (step, epoch, loops, callbacks, hyperparameters).
Whatever layout saved it (ZeRO-3, tensor or pipeline parallel), DCP stores every tensor under its
global name and shape, so one process reads it back whole, without a process group. A checkpoint
saved with ``save_distributed_checkpoint=False`` (or by Lightning's one-device, DDP and full-state FSDP strategies)
is already one ``.ckpt`` file; Lightning's sharded FSDP checkpoints are read like this package's, DeepSpeed
directories through DeepSpeed's own consolidation (:mod:`.deepspeed_read`).

Usage (``lightning-llm export CKPT OUT --format torch`` does the same)::

    python -m lightning_llm.checkpoint runs/step=1000.ckpt model.pt
    state = torch.load("model.pt", weights_only=True)["state_dict"]   # full, unsharded tensors

Checkpoints are read weights-only (:mod:`lightning_llm.checkpointing.untrusted`): a file holding any other pickled
object is refused naming it, never unpickled.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_llm._compat.lightning import METADATA_FILENAME
from lightning_llm._compat.torch_distributed import load_whole_checkpoint
from lightning_llm.checkpointing import fs as cfs
from lightning_llm.checkpointing.dcp_load import model_key
from lightning_llm.checkpointing.deepspeed_read import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from lightning_llm.checkpointing.errors import write_named
from lightning_llm.checkpointing.optimizer_layout import from_named_groups, lightning_layout
from lightning_llm.checkpointing.untrusted import bytes_checked, load_torch, refusals_unwrapped, safe_planner

MODEL_KEY = "state_dict"  # Lightning's key of the model's tensors; DCP stores them as "state_dict.<name>"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_checkpoint(path: Path) -> None:
    """Refuse what is not a DCP directory or a checkpoint file, naming what it looks like instead."""
    if path.is_file():
        return
    if not path.exists():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} does not exist; pass a .ckpt file or a sharded checkpoint directory."
        )
    if (path / ".metadata").is_file() or is_deepspeed_checkpoint(path):
        return
    raise ValueError(
        f"{path} is neither a checkpoint file, a sharded checkpoint directory (no .metadata inside) nor a DeepSpeed "
        "one (no 'latest' file); pass a .ckpt file or a directory saved by a Lightning strategy."
    )


def _lightning_file(path: Path) -> dict[str, Any]:
    """A checkpoint file, memory-mapped and read weights-only; refused unless it is Lightning's (a ``state_dict``)."""
    loaded = load_torch(path, mmap=True)
    if not isinstance(loaded, dict) or not isinstance(loaded.get(MODEL_KEY), dict):
        keys = f" with keys {sorted(map(str, loaded))[:8]}" if isinstance(loaded, dict) else ""
        raise ValueError(
            f"{path} holds no {MODEL_KEY!r} entry, so it is not a Lightning checkpoint (it holds a "
            f"{type(loaded).__name__}{keys}); pass a checkpoint saved by trainer.save_checkpoint, ModelCheckpoint "
            "or CheckpointRotation."
        )
    return loaded


def read_model_state(checkpoint: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's full tensors and the checkpoint's other entries (``hyper_parameters``, ``global_step``, ...).

    A sharded directory is read by DCP in this one process (no process group); only the model's
    tensors are read, not the optimizer state. A file is memory-mapped.

    Example::

        state, rest = read_model_state("checkpoints/step=1000.ckpt")
        model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    """
    path = Path(checkpoint)
    _check_checkpoint(path)
    if path.is_file():
        rest = _lightning_file(path)
        return rest.pop(MODEL_KEY), rest
    if is_deepspeed_checkpoint(path):
        rest = read_deepspeed_checkpoint(path)
        rest.pop("optimizer_states")
        return rest.pop(MODEL_KEY), rest
    metadata = cfs.storage_reader(str(path)).read_metadata()  # .metadata checked: DCP's classes only
    key = model_key(metadata.state_dict_metadata)  # FSDPStrategy's sharded checkpoints: "model."
    prefix = f"{key}."
    state = {
        key[len(prefix) :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    nested = {key: state}
    with warnings.catch_warnings(), refusals_unwrapped():  # DCP warns that it reads in one process: the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(nested, storage_reader=cfs.storage_reader(str(path)), planner=safe_planner(path), no_dist=True)
    meta = path / METADATA_FILENAME
    rest = load_torch(meta) if meta.is_file() else {}
    return nested[key], rest


def cast_floats(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors in ``dtype`` (integer buffers and ``None`` dtype: unchanged)."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in state.items()}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16``; refuses names outside :data:`DTYPES`."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported; choose one of {sorted(DTYPES)} (or leave it unset to keep the saved dtype)."
        )
    return DTYPES[name]


def consolidate_checkpoint(
    checkpoint: str | Path, output_file: str | Path, dtype: str | torch.dtype | None = None
) -> Path:
    """Write the full (unsharded) state of a checkpoint (sharded or DeepSpeed directory, or ``.ckpt`` file) to
    ``output_file``.

    The file holds Lightning's checkpoint keys (``state_dict``, ``optimizer_states``, ``global_step``,
    ...) with plain tensors, so ``torch.load(f)["state_dict"]`` fits ``model.load_state_dict`` and a single-device
    or DDP Trainer resumes from it (``ckpt_path=``), optimizer state included: each saved optimizer's name-keyed
    state is rewritten in torch's own layout (:mod:`lightning_llm.checkpointing.optimizer_layout`).
    A directory is read whole as torch's ``dcp_to_torch_save`` does; Lightning's ``meta.pt`` entries are then
    merged in. ``dtype`` casts the model's floating-point tensors (``state_dict``); optimizer state
    is left as saved.

    Example::

        consolidate_checkpoint("checkpoints/last.ckpt", "last-full.pt", dtype="bfloat16")
    """
    source, output_file = Path(checkpoint), Path(output_file)
    _check_checkpoint(source)
    dtype = parse_dtype(dtype)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    partial = output_file.with_name(output_file.name + ".partial")
    if is_deepspeed_checkpoint(source):
        state = read_deepspeed_checkpoint(source)  # DeepSpeed's own consolidation, optimizer moments included
        state["optimizer_states"] = [from_named_groups(s) for s in state["optimizer_states"]]
    elif source.is_dir():
        # torch's dcp_to_torch_save, with the .metadata checked and byte entries read weights-only.
        with refusals_unwrapped():
            state = load_whole_checkpoint(cfs.storage_reader(str(source)), planner_mixin=bytes_checked(source))
        if MODEL_KEY not in state and "model" in state:  # FSDPStrategy's sharded checkpoints
            state[MODEL_KEY] = state.pop("model")
        write_named(output_file, lambda: torch.save(_optimizers_in_lightning_layout(state), partial), partial)
        meta = source / METADATA_FILENAME
        if not meta.is_file() and dtype is None:
            os.replace(partial, output_file)
            return output_file
        # Merge Lightning's entries; the tensors are memory-mapped from the file just written, not copied.
        state = torch.load(partial, weights_only=True, mmap=True)  # written just above, of checked content
        if meta.is_file():
            state.update(load_torch(meta))
    elif dtype is None:
        _lightning_file(source)  # refuses a file that holds more than tensors and plain values, or no state_dict
        write_named(output_file, lambda: shutil.copyfile(source, partial), partial)
        os.replace(partial, output_file)
        return output_file
    else:
        state = _lightning_file(source)
    state[MODEL_KEY] = cast_floats(state[MODEL_KEY], dtype)
    temporary = output_file.with_name(output_file.name + ".tmp")
    write_named(output_file, lambda: torch.save(state, temporary), temporary)
    os.replace(temporary, output_file)
    partial.unlink(missing_ok=True)
    return output_file


def _optimizers_in_lightning_layout(state: dict[str, Any]) -> dict[str, Any]:
    # The shards hold optimizer_0, optimizer_1, ... (name-keyed); Lightning's file holds the list optimizer_states.
    keys = sorted((k for k in state if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k.split("_")[1]))
    if keys:
        names = list(state.get(MODEL_KEY, {}))
        state["optimizer_states"] = [lightning_layout(state.pop(key), names) for key in keys]
    return state


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_llm.checkpoint CKPT OUT``: an alias of ``lightning-llm export CKPT OUT --format torch``."""
    parser = argparse.ArgumentParser(description=consolidate_checkpoint.__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", help="a sharded checkpoint directory saved by LLMParallelStrategy, or a .ckpt file"
    )
    parser.add_argument("output_file", help="where to write the single-file checkpoint")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the model's tensors (default: as saved)")
    args = parser.parse_args(argv)
    print(consolidate_checkpoint(args.checkpoint, args.output_file, args.dtype))
