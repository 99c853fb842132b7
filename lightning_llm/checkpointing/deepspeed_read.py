"""A DeepSpeed checkpoint directory read as one full Lightning checkpoint, optimizer state included, by DeepSpeed's own
consolidation: what lets a run saved by Lightning's ``DeepSpeedStrategy`` (or ``LLMDeepSpeedStrategy``) continue under
``LLMParallelStrategy`` or be exported.

DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` (its ``zero_to_fp32``) rebuilds every parameter from the flat
fp32 partitions each rank saved. The optimizer's base state is kept over those same flat partitions, element for
element (the base optimizer steps them), so the same consolidation run on a copy of the checkpoint whose partitions
are a moment (``exp_avg``, ``exp_avg_sq``, ...) rebuilds that moment per parameter. Scalars (``step``) and
hyperparameters belong to a partition's parameter group and go to each of its parameters. What does not fit that
description (state not laid out like the partitions, groups DeepSpeed did not record) is refused naming the fix.

Every ``.pt`` file is first checked to import nothing beyond torch's weights-only set and DeepSpeed's own classes
(:func:`.deepspeed.unsafe_pickle_refusal`): DeepSpeed unpickles its files in full.

Example::

    checkpoint = read_deepspeed_checkpoint("checkpoints/epoch=0-step=100.ckpt")
    checkpoint["state_dict"], checkpoint["optimizer_states"][0]["state"]["model.norm.weight"]["exp_avg"]
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_llm.checkpointing.deepspeed import unsafe_pickle_refusal

# DeepSpeed's own entries of its model-states file; everything else there is Lightning's (loops, callbacks, ...).
DEEPSPEED_KEYS = frozenset(
    [
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "csr_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
    ]
)
_WRAPPER = "_forward_module."  # Lightning < 2.1 saved the module under its wrapper


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory DeepSpeed saved (its ``latest`` tag file)."""
    return Path(path).is_dir() and (Path(path) / "latest").is_file()


def read_deepspeed_checkpoint(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict of a DeepSpeed checkpoint: ``state_dict`` (fp32, whole), ``optimizer_states``
    (one name-keyed state in torch's form) and Lightning's own entries.

    ``weights_only=False`` trusts the files (``trainer.fit(..., weights_only=False)``); otherwise they are scanned
    before DeepSpeed unpickles them.
    """
    path = Path(path)
    refusal = unsafe_pickle_refusal(path) if weights_only is not False else None
    if refusal is not None:
        raise ValueError(refusal)
    tag = (path / "latest").read_text().strip()
    model_file = sorted((path / tag).glob("*model_states.pt"))[0]
    client = torch.load(model_file, map_location="cpu", weights_only=False)  # scanned above
    checkpoint = {k: v for k, v in client.items() if k not in DEEPSPEED_KEYS}
    checkpoint["state_dict"] = {k.removeprefix(_WRAPPER): v for k, v in _consolidate(path, tag).items()}
    groups = [[name.removeprefix(_WRAPPER) for name in group] for group in _as_list(client["param_shapes"])]
    checkpoint["optimizer_states"] = [_optimizer_state(path, tag, groups)]
    return checkpoint


def _optimizer_state(path: Path, tag: str, groups: list[list[str]]) -> dict[str, Any]:
    """The base optimizer's state per parameter: each tensor field consolidated like the weights."""
    files = _natural(sorted((path / tag).glob("*_optim_states.pt")))
    saved = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    stage = saved[0]["zero_stage"]
    partitions_key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    base = [s["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"] for s in saved]
    states = [b["state"] if "state" in b else dict(enumerate(b)) for b in base]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in base[0].get("param_groups", [])]
    if len(hyper) != len(groups) or len(states[0]) != len(groups):
        raise ValueError(
            f"DeepSpeed checkpoint {path} (ZeRO stage {stage}) keeps its optimizer state in {len(states[0])} "
            f"partitions for {len(groups)} parameter groups, which this reader cannot map to parameters. Resume the "
            "weights only (load checkpoint['state_dict'] of lightning.pytorch.utilities.deepspeed."
            "convert_zero_checkpoint_to_fp32_state_dict into the model and fit without ckpt_path)."
        )
    fields = [k for k, v in states[0][0].items() if torch.is_tensor(v) and v.dim() > 0]
    per_field = {f: _consolidate_field(path, tag, saved, states, partitions_key, f) for f in fields}
    state: dict[str, dict[str, Any]] = {}
    for index, names in enumerate(groups):
        scalars = {k: v for k, v in states[0][index].items() if k not in fields}
        for name in names:  # each its own copy: torch's optimizers count `step` up in place, per parameter
            own = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
            state[name] = {**own, **{f: per_field[f][name] for f in fields}}
    param_groups = [{**hyper[i], "params": list(names)} for i, names in enumerate(groups)]
    return {"state": state, "param_groups": param_groups}


def _consolidate_field(path: Path, tag: str, saved: list, states: list, key: str, field: str) -> dict:
    """DeepSpeed's consolidation of one optimizer field: a copy of the checkpoint whose fp32 partitions are it."""
    with tempfile.TemporaryDirectory(prefix="lightning_llm-deepspeed-") as tmp:
        (Path(tmp) / "latest").write_text(tag)
        (Path(tmp) / tag).mkdir()
        for model_file in (path / tag).glob("*model_states.pt"):
            (Path(tmp) / tag / model_file.name).symlink_to(model_file.resolve())
        for rank, (optim, state) in enumerate(zip(saved, states)):
            partitions = [_padded(state[i][field], p) for i, p in enumerate(optim[key])]
            minimal = {k: optim[k] for k in ("zero_stage", "partition_count", "param_alignment_paddings") if k in optim}
            name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            torch.save({"optimizer_state_dict": {**minimal, key: partitions}}, Path(tmp) / tag / name)
        return _consolidate(Path(tmp), tag)


def _padded(value: torch.Tensor, partition: torch.Tensor) -> torch.Tensor:
    """``value`` laid out as ``partition`` (DeepSpeed may save state without the partition's alignment padding)."""
    flat = value.reshape(-1).to(partition.dtype)
    if flat.numel() == partition.numel():
        return flat
    if flat.numel() > partition.numel():
        raise ValueError(f"optimizer state of {flat.numel()} elements for a partition of {partition.numel()}")
    return torch.cat([flat, flat.new_zeros(partition.numel() - flat.numel())])


def _consolidate(path: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)  # prints and progress bars: not ours


def _as_list(param_shapes: Any) -> list:
    return param_shapes if isinstance(param_shapes, list) else [param_shapes]


def _natural(files: list[Path]) -> list[Path]:
    """Rank order (``zero_pp_rank_10`` after ``zero_pp_rank_9``), as DeepSpeed reads them."""
    import re

    return sorted(files, key=lambda f: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", f.name)])
