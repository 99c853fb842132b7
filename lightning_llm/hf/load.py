"""Load a local Hugging Face checkpoint directory straight into a sharded, split or tensor-parallel model.

Each rank opens the safetensors files lazily (``safe_open``) and reads only what it holds: the rows
of its FSDP shard, or, for other placements (TP, TP x FSDP), the tensor it then slices with
``distribute_tensor(src_data_rank=None)`` (no communication). Parameters are matched by name: a
module whose parameter names end in the Hugging Face names (``HFCausalLM``'s ``model.`` prefix,
any LightningModule holding a ``PreTrainedModel`` as an attribute) needs no table. The reference
:class:`~lightning_llm.models.llama.Llama` (``CausalLM``) loads a Hugging Face Llama directory through
:mod:`lightning_llm.hf.llama_map` (names, and q/k rows from ``rotate_half`` order back to interleaved
pairs). Pipeline stages simply hold fewer parameters. A DeepSpeed ZeRO-3 parameter (``LLMDeepSpeedStrategy``)
receives only its partition, the contiguous range ``[rank * p, (rank + 1) * p)`` of the flattened tensor, read as
the rows that cover it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def checkpoint_files(hf_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of a Hugging Face directory to its safetensors file (single file or sharded + index).

    A single ``model.safetensors`` wins over an index beside it, as in transformers' ``from_pretrained``: the index
    is then most likely left over from an earlier sharded save.
    """
    if "://" in str(hf_dir):
        raise ValueError(
            f"load_pretrained={str(hf_dir)!r} is a URL; it reads a local Hugging Face directory (safetensors files "
            "are opened lazily, per rank). Copy the checkpoint to a local disk and pass that path."
        )
    hf_dir = Path(hf_dir)
    index, single = hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"
    if single.is_file():
        if index.is_file():
            rank_zero_info(
                f"load_pretrained: reading {single}; {index.name} beside it is ignored, as transformers does"
            )
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if not index.is_file():
        raise FileNotFoundError(
            f"{hf_dir} holds neither model.safetensors nor model.safetensors.index.json; save the model with "
            "save_pretrained(..., safe_serialization=True) (PyTorch .bin files are not read)."
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {err!r}. Save the model "
            "again with save_pretrained."
        ) from None
    return {name: hf_dir / file for name, file in weight_map.items()}


@contextlib.contextmanager
def open_safetensors(file: Path):
    """``safe_open`` with the file named in its errors (a truncated or corrupted file, a missing shard)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(file, framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{file} cannot be read as safetensors ({err}); it may be truncated, corrupted or missing. Copy or save "
            "the checkpoint again."
        ) from None
    with handle as f:
        yield f


def match_names(module_names: list[str], checkpoint_names: set[str]) -> tuple[str, dict[str, str]]:
    """The prefix that, stripped from the module's names, gives the checkpoint's names; and the mapping."""
    for candidate in sorted(
        {n[: len(n) - len(c)] for n in module_names for c in checkpoint_names if n.endswith(c)}, key=len
    ):
        if candidate and not candidate.endswith("."):
            continue
        mapping = {n: n[len(candidate) :] for n in module_names if n.startswith(candidate)}
        if sum(v in checkpoint_names for v in mapping.values()) * 2 >= len(module_names):
            return candidate, mapping
    raise ValueError(
        f"The checkpoint's tensor names (e.g. {sorted(checkpoint_names)[:3]}) do not match the model's parameter "
        f"names (e.g. {module_names[:3]}) under any prefix; load into the Hugging Face model class that saved them."
    )


def _reference_llama(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(prefix, model) of the outermost reference Llama inside ``module``, if any."""
    from lightning_llm.models.llama import Llama

    return next(
        ((f"{name}." if name else "", sub) for name, sub in module.named_modules() if isinstance(sub, Llama)), None
    )


def _llama_mapping(module: nn.Module, all_names: list[str], files: dict[str, Path], hf_dir: str | Path):
    """For a reference Llama and a Hugging Face Llama directory: (prefix, name mapping, per-name transforms); else None."""
    found = _reference_llama(module)
    if found is None or "model.embed_tokens.weight" not in files:
        return None
    import transformers

    from lightning_llm.hf import llama_map

    prefix, llama = found
    if not (Path(hf_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"{Path(hf_dir) / 'config.json'} is missing: loading a Hugging Face Llama into the reference model "
            "compares the two configs first. Copy config.json beside the weights (save_pretrained writes it)."
        )
    llama_map.check_same_function(llama.config, transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True))
    ours = [n for n in all_names if n.startswith(prefix)]
    mapping = {n: llama_map.to_hf_name(n[len(prefix) :]) for n in ours}
    transforms = {
        n: (lambda t, ref=n[len(prefix) :]: llama_map.from_hf_tensor(ref, t, llama.config))
        for n in ours
        if n.endswith(("q_proj.weight", "k_proj.weight"))
    }
    return prefix, mapping, transforms


def _read(file_handle, key: str, target: torch.Tensor, transform: Callable | None = None) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``key`` for ``target`` (a parameter, possibly a DTensor).

    ``transform`` (a row permutation) is applied to the whole tensor before this rank's part is cut.
    """
    if transform is not None:
        full = transform(file_handle.get_tensor(key))
        if isinstance(target, DTensor):
            return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        return full
    if isinstance(target, DTensor):
        if target.device_mesh.ndim == 1 and target.placements == (Shard(0),):
            rows = target.shape[0]
            per_rank = -(-rows // target.device_mesh.size())
            start = min(rows, per_rank * target.device_mesh.get_local_rank())
            return file_handle.get_slice(key)[start : min(rows, start + per_rank)]
        full = file_handle.get_tensor(key)
        return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    return file_handle.get_tensor(key)


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    """The full shape: a DeepSpeed ZeRO-3 parameter keeps it in ``ds_shape`` (its ``shape`` is an empty stand-in)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def _read_partition(file_handle, key: str, param: torch.Tensor, transform: Callable | None) -> torch.Tensor | None:
    """This rank's ZeRO-3 partition of checkpoint tensor ``key`` (flat), read as the rows that cover it; None if
    the rank holds only padding."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
        raise RuntimeError(f"{key}: a ZeRO-3 parameter is gathered while loading; load before training starts.")
    numel, size = param.ds_numel, param.ds_tensor.ds_numel
    rank = torch.distributed.get_rank(group=param.ds_process_group)
    low, high = min(numel, rank * size), min(numel, (rank + 1) * size)
    if high <= low:
        return None
    shape = _shape(param)
    if transform is not None or len(shape) < 1 or shape[0] == 0:
        full = file_handle.get_tensor(key)
        return (transform(full) if transform is not None else full).reshape(-1)[low:high]
    row = numel // shape[0]
    first, last = low // row, -(-high // row)
    return file_handle.get_slice(key)[first:last].reshape(-1)[low - first * row : high - first * row]


def _copy_into(param: torch.Tensor, file_handle, key: str, transform: Callable | None, file: Path) -> None:
    if hasattr(param, "ds_tensor"):  # DeepSpeed ZeRO 3: write the partition DeepSpeed builds its engine from
        part = _read_partition(file_handle, key, param, transform)
        if part is not None:
            _check_finite(part, key, file)
            param.ds_tensor.narrow(0, 0, part.numel()).copy_(part.to(param.ds_tensor.dtype))
        return
    local = param.to_local() if isinstance(param, DTensor) else param
    part = _read(file_handle, key, param, transform)
    if local.numel():
        _check_finite(part, key, file)
        local.copy_(part.to(local.dtype))


def _check_finite(part: torch.Tensor, key: str, file: Path) -> None:
    if part.is_floating_point() and not torch.isfinite(part).all():
        bad = int((~torch.isfinite(part)).sum())
        raise ValueError(
            f"{file}: tensor {key!r} holds {bad} non-finite values (NaN or inf) in the part this rank loads; training "
            "from it would give NaN losses. Load a checkpoint that is intact (re-download or re-export it)."
        )


# safetensors dtype names that are not floating point: loading them into float weights would cast, not load.
_NOT_FLOAT = ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64")


@torch.no_grad()
def load_pretrained(module: nn.Module, hf_dir: str | Path) -> list[str]:
    """Copy a Hugging Face checkpoint's tensors into ``module``'s (sharded) parameters; returns the names loaded.

    Refuses, before copying anything, checkpoints that miss a parameter the model holds, hold
    tensors the model does not have (on no rank or stage), or whose shapes differ.

    A reference ``Llama`` inside ``module`` loads a Hugging Face Llama directory whose config computes the
    same function (checked field by field: widths, heads, rotary base, norm epsilon, tied embeddings).

    Example::

        model = HFCausalLM(...)                     # on meta, sharded (FSDP2/TP/PP or ZeRO-3), materialized
        load_pretrained(model, "checkpoints/llama-hf")
        load_pretrained(Llama(llama_map.from_hf_config(AutoConfig.from_pretrained(d))), d)   # reference Llama
    """
    files = checkpoint_files(hf_dir)
    params = dict(module.named_parameters())
    all_names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    llama = _llama_mapping(module, all_names, files, hf_dir)
    prefix, mapping, transforms = llama if llama is not None else (*match_names(all_names, set(files)), {})
    by_file: dict[Path, list[str]] = {}
    for name in params:
        if name in mapping and mapping[name] in files:
            by_file.setdefault(files[mapping[name]], []).append(name)
    _refuse_misfits(hf_dir, prefix, params, mapping, files, by_file, _expected_on_any_rank(mapping, all_names))
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            for name in names:
                _copy_into(params[name], f, mapping[name], transforms.get(name), file)
    rank_zero_info(
        f"load_pretrained: {len(params)} tensors ({sum(_numel(params[n]) for n in params) / 1e6:.1f}M parameters) "
        f"from {hf_dir} ({len(set(files.values()))} file(s)" + (f", names under {prefix!r}" if prefix else "") + ")"
    )
    return sorted(params)


def _expected_on_any_rank(mapping: dict[str, str], all_names: list[str]) -> set[str]:
    """The checkpoint names some rank's parameters map to: pipeline stages each hold part of the names."""
    expected = {mapping[n] for n in all_names if n in mapping}
    if torch.distributed.is_initialized():
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, expected)
        expected = set().union(*every)
    return expected


def _refuse_misfits(
    hf_dir: str | Path,
    prefix: str,
    params: dict[str, torch.Tensor],
    mapping: dict[str, str],
    files: dict[str, Path],
    by_file: dict[Path, list[str]],
    expected: set[str],
) -> None:
    """Refuse, before anything is copied, a checkpoint missing a parameter of this rank, holding a tensor no rank
    has, or whose shapes or (integer, boolean) dtypes differ from the parameters'."""
    missing = sorted(n for n in params if mapping.get(n) not in files)
    unexpected = sorted(set(files) - expected)
    shapes, dtypes = [], []
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            for name in names:
                tensor = f.get_slice(mapping[name])
                saved = tuple(tensor.get_shape())
                if saved != _shape(params[name]):
                    shapes.append(f"{mapping[name]}: checkpoint {saved}, model {_shape(params[name])}")
                if tensor.get_dtype() in _NOT_FLOAT and params[name].is_floating_point():
                    dtypes.append(f"{mapping[name]} ({tensor.get_dtype()}) in {file.name}")
    if missing or unexpected or shapes:
        raise ValueError(
            f"{hf_dir} does not fit the model (names compared after removing the prefix {prefix!r}): missing "
            f"{missing[:10]}, unexpected {unexpected[:10]}, mis-shaped {shapes[:10]}. Load a checkpoint of the same "
            "architecture and config (vocab size, layers, widths)."
        )
    if dtypes:
        raise ValueError(
            f"{hf_dir} holds integer or boolean tensors where the model has floating-point weights: {dtypes[:10]}. "
            "They would be cast, not loaded; the checkpoint is not a set of weights for this model."
        )


def _numel(param: torch.Tensor) -> int:
    shape = _shape(param)
    return int(torch.Size(shape).numel())
