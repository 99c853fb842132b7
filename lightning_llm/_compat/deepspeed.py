"""Private DeepSpeed APIs: ZeRO-3 parameter conversion and partition sizing on ``deepspeed.zero.Init``.

DeepSpeed is optional: nothing is imported here until an accessor is called.
"""

from __future__ import annotations

from lightning_llm._compat.registry import Private, register, resolve

CHECKED = "deepspeed 0.19.8"


def convert_to_deepspeed_param(init, param) -> None:
    """``zero.Init._convert_to_deepspeed_param(param)``: give a new parameter the ZeRO-3 ``ds_*`` attributes and
    all_gather/partition methods without partitioning it. DeepSpeed's public ``zero.Init(module=...)`` broadcasts
    every whole parameter from rank 0 first. Checked on deepspeed 0.19.8."""
    init._convert_to_deepspeed_param(param)


def aligned_size(init, param) -> int:
    """``zero.Init._aligned_size(param)``: the parameter's element count padded to a multiple of the partition
    world size. Checked on deepspeed 0.19.8."""
    return init._aligned_size(param)


def partition_world_size(init, param) -> int:
    """``zero.Init._partition_world_size(param)``: the ranks the parameter is partitioned over. Checked on deepspeed
    0.19.8."""
    return init._partition_world_size(param)


def _check():
    try:
        init = resolve("deepspeed.runtime.zero.partition_parameters:Init")
    except ImportError:
        return "skipped: deepspeed is not installed"
    return (init._convert_to_deepspeed_param, init._aligned_size, init._partition_world_size)


register(
    Private(
        name="deepspeed.zero.Init._convert_to_deepspeed_param, _aligned_size, _partition_world_size",
        upstream="deepspeed",
        accessor="deepspeed.convert_to_deepspeed_param, aligned_size, partition_world_size",
        used_by=("parallel/init/zero3_build.py",),
        why="create a ZeRO-3 parameter with an empty partition of this rank's size from a meta parameter (DeepSpeed's "
        "public `zero.Init(module=...)` broadcasts every whole parameter from rank 0 first), then write the model's "
        "own init and pretrained weights straight into the partitions (the public `ds_*` attributes are used directly)",
        caught_by="`tests/strategies/test_deepspeed_init.py` (bit-identical init), `tests/test_setup_memory.py`, "
        "`tests/hf/test_load_pretrained.py`",
        checked=CHECKED,
        check=_check,
    )
)
