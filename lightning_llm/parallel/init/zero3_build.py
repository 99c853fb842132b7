"""Turn a model built on the meta device into ZeRO-3 partitioned parameters, allocating only each rank's partitions.

``deepspeed.zero.Init`` builds each module for real and partitions its parameters when the module's
``__init__`` returns, so every module is whole on every rank for a moment: a 128k-vocabulary
embedding is 1 GiB, and a tied output head first builds its own 1 GiB weight before the tie replaces
it (measured: 2263 MiB per rank just to build a 1466 MiB model on 2 ranks). Its public
``zero.Init(module=...)`` converts an existing model by broadcasting each whole parameter from rank 0
and then keeping this rank's slice, which needs every parameter whole, with values, on every rank.

Here the model is built on the meta device (nothing allocated, ties kept: one ``Parameter``), then
:func:`partition_meta_model` gives each meta parameter DeepSpeed's ZeRO-3 attributes and methods and
an *empty partition* of this rank's size (the model's own init fills it next,
:func:`lightning_llm.parallel.init.zero3_init.initialize_partitioned`); meta buffers are allocated whole
on the local device (buffers are never partitioned). The only DeepSpeed internals used are isolated
in :func:`_partition_without_data`.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_llm._compat.deepspeed import aligned_size, convert_to_deepspeed_param, partition_world_size
from lightning_llm._compat.torch import module_buffers, module_parameters


def zero_init(config: dict, remote_device=None):
    """A ``deepspeed.zero.Init`` for ``config`` (the strategy's, as Lightning passes it), not entered: only its
    partitioning settings (process group, dtype, devices, persistence threshold) and parameter methods are used."""
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=config, remote_device=remote_device)


def partitions_directly(init) -> str | None:
    """``None`` when :func:`partition_meta_model` supports ``init``'s configuration, else the reason it does not
    (then the strategy builds under ``zero.Init`` as DeepSpeed does)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    if init.remote_device == OffloadDeviceEnum.nvme:
        return "parameters offloaded to NVMe (DeepSpeed's swapper owns those partitions)"
    if init.zero_param_process_group is not None:
        return "hierarchical partitioning (zero_hpz_partition_size > 1: secondary partitions)"
    if init.quantized_weights or init.quantized_nontrainable_weights or init.quantized_initialization:
        return "quantized weights"
    return None


def _partition_without_data(init, param: nn.Parameter) -> None:
    """Give ``param`` (full shape, no values) ZeRO-3's attributes and an empty partition of this rank's size.

    DeepSpeed internal, isolated here on purpose: DeepSpeed has no public way to create a partitioned parameter
    without its values (``zero.Init(module=...)`` broadcasts the whole tensor from rank 0 first). This does what
    ``Init._zero_init_param`` + ``Init._partition_param`` do for a new parameter, minus the broadcast and the copy
    of this rank's slice: ``_convert_to_deepspeed_param`` (ds_* attributes, all_gather/partition methods), a
    partition of ``aligned_size / world`` elements on the device DeepSpeed would pick, and the empty stand-in
    ``free_param`` leaves in ``param.data``. Checked against DeepSpeed 0.19 by tests/strategies/test_deepspeed_init.py.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

    convert_to_deepspeed_param(init, param)
    aligned = aligned_size(init, param)
    size = aligned // partition_world_size(init, param)
    device = init.local_device if param.ds_persist else init.remote_device
    partition = torch.empty(size, dtype=param.dtype, device=device)
    if device == OffloadDeviceEnum.cpu and init.pin_memory:
        partition = get_accelerator().pin_memory(partition)
    partition.requires_grad = False
    partition.ds_numel, partition.status, partition.final_location = size, PartitionedParamStatus.AVAILABLE, None
    param.ds_tensor, param.ds_numel_aligned = partition, aligned
    param.data = torch.empty(0, dtype=param.dtype, device=init.local_device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def partition_meta_model(module: nn.Module, init) -> set[int]:
    """Replace every meta parameter of ``module`` by a ZeRO-3 parameter holding only this rank's (empty) partition,
    and allocate every meta buffer on the local device; returns the ids of the new tensors, which the model's init
    must fill. Tied parameters stay one ``Parameter``; the old parameter's Python attributes are kept.

    Floating-point parameters take ``init``'s dtype (the config's fp16/bf16, as under ``zero.Init``).

    Example::

        with torch.device("meta"):
            model = Llama(config)
        fresh = partition_meta_model(model, zero_init(ds_config))
        initialize_partitioned(model, rng_state, fresh=fresh)
    """
    replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old kept alive: ids stay unique, new)
    for owner in module.modules():
        for name, param in list(module_parameters(owner).items()):
            if param is None or not (param.is_meta or id(param) in replaced):
                continue
            if id(param) not in replaced:
                dtype = init.dtype if param.is_floating_point() else param.dtype
                full_shape = torch.empty((), dtype=dtype, device=init.local_device).expand(param.shape)
                new = nn.Parameter(full_shape, requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                _partition_without_data(init, new)
                replaced[id(param)] = (param, new)
            module_parameters(owner)[name] = replaced[id(param)][1]
        for name, buffer in list(module_buffers(owner).items()):
            if buffer is None or not (buffer.is_meta or id(buffer) in replaced):
                continue
            if id(buffer) not in replaced:
                replaced[id(buffer)] = (buffer, torch.empty_like(buffer, device=init.local_device))
            module_buffers(owner)[name] = replaced[id(buffer)][1]
    return {id(new) for _, new in replaced.values()}
