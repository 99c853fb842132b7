"""Run a model's own init on a ZeRO-3 partitioned model: built on meta and partitioned by
:mod:`lightning_llm.parallel.init.zero3_build` (empty partitions), or built inside ``deepspeed.zero.Init``.

Under ``deepspeed.zero.Init`` (Lightning's ``DeepSpeedStrategy``), the parameters of every module are
partitioned across the ranks as soon as that module's ``__init__`` returns. An init that runs
after the children exist (a root ``reset_parameters()``/``init_weights()`` such as the reference
``Llama``'s std 0.02 with depth-scaled projections, Hugging Face's ``post_init()``) then sees empty
placeholders and does nothing. Measured before this module: the reference model and a Hugging Face
Llama kept torch's per-layer defaults (embedding std 1.0 instead of 0.02, Linear weights ~0.072).

:func:`initialize_partitioned` runs the model's init entry points again (found as for the meta device,
:func:`~lightning_llm.parallel.init.entry.init_entry_points`), from the random state the ranks had
before the model was built, on full-size parameters: each parameter shows its full shape (a view
expanded from one element) to the init code, and is gathered with ``deepspeed.zero.GatheredParameters(modifier_rank=0)``
only when an op touches it; a few at a time stay gathered (:data:`LIVE_BYTES`), then DeepSpeed
re-partitions them. A random fill of a whole parameter (``normal_``, ``uniform_``: the bulk of an LLM's init)
is not gathered: each rank draws the full tensor's numbers in 16 MiB chunks (as
:mod:`lightning_llm.parallel.init.materialize` does for FSDP rows) and keeps only its partition, the contiguous range
``[rank * p, (rank + 1) * p)`` of the flattened tensor. Every rank draws each whole tensor in the order one
process would, so the values equal, bit for bit, the model's init in one process (and ``LLMParallelStrategy``'s)
for the same seed.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from lightning_llm._compat.torch import TorchDispatchMode, tree_leaves
from lightning_llm.parallel.init import materialize
from lightning_llm.parallel.init.entry import init_entry_points
from lightning_llm.parallel.init.materialize import RandomFill
from lightning_llm.parallel.seeding import agree_on_seed

LIVE_BYTES = 64 << 20  # parameters kept gathered at once (at least one, whatever its size)


def is_partitioned(tensor: torch.Tensor) -> bool:
    """A ZeRO-3 parameter whose values live only in the ranks' partitions (not gathered now)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return hasattr(tensor, "ds_id") and tensor.ds_status == ZeroParamStatus.NOT_AVAILABLE


class _GatherOnTouch(TorchDispatchMode):
    """Gathers a partitioned parameter when an op reads or writes it; releases the least recently used ones."""

    def __init__(self, params: list[nn.Parameter], live_bytes: int) -> None:
        super().__init__()
        self.pending = {id(p): p for p in params}
        self.live: OrderedDict[int, object] = OrderedDict()  # id -> its entered GatheredParameters
        self.live_bytes, self.budget = 0, live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in materialize._CHUNKABLE and id(args[0]) in self.pending and id(args[0]) not in self.live:
            _fill_partition(self.pending[id(args[0])], func, args[1:], kwargs)  # drawn in chunks, never gathered
            return args[0]
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor) and id(tensor) in self.pending:
                self._gather(self.pending[id(tensor)])
        return func(*args, **kwargs)

    def _gather(self, param: nn.Parameter) -> None:
        import deepspeed

        if id(param) in self.live:
            self.live.move_to_end(id(param))
            return
        size = param.ds_numel * param.element_size()
        while self.live and self.live_bytes + size > self.budget:
            self._release(next(iter(self.live)))
        context = deepspeed.zero.GatheredParameters([param], modifier_rank=0)
        context.__enter__()
        self.live[id(param)] = context
        self.live_bytes += size

    def _release(self, key: int) -> None:
        param = self.pending[key]
        self.live.pop(key).__exit__(None, None, None)  # rank 0's values (equal on every rank) re-partitioned
        self.live_bytes -= param.ds_numel * param.element_size()
        _show_full_shape(param)

    def release_all(self) -> None:
        while self.live:
            self._release(next(iter(self.live)))


def _fill_partition(param: nn.Parameter, op, args: tuple, kwargs: dict) -> None:
    """Run the random fill ``op`` on the whole (flattened) parameter with the global generator, keeping this rank's
    partition: the numbers of one call on the contiguous full tensor (see :func:`lightning_llm.parallel.init.materialize._draw`)."""
    import torch.distributed as dist

    numel, size = param.ds_numel, param.ds_tensor.ds_numel
    rank = dist.get_rank(group=param.ds_process_group)
    low, high = min(numel, rank * size), min(numel, (rank + 1) * size)
    fill = RandomFill(frozenset(), op, (numel,), param.dtype, tuple(args), dict(kwargs))
    out = param.ds_tensor.narrow(0, 0, high - low) if high > low else None
    if out is not None and out.device.type != "cpu":  # draws come from the CPU generator, as in materialize
        staged = torch.empty(high - low, dtype=out.dtype)
        materialize._draw(fill, keep_rows=(low, high), out=staged)
        out.copy_(staged)
        return
    materialize._draw(fill, keep_rows=(low, high), out=out)


def _show_full_shape(param: nn.Parameter) -> None:
    """Give a partitioned parameter its full shape, backed by one element: init code reads ``dim()``/``shape``
    before any op (a meta tensor cannot stand in: ``set_data`` refuses another device type)."""
    param.data = torch.empty((), dtype=param.dtype, device=param.device).expand(param.ds_shape)


def initialize_partitioned(
    module: nn.Module, rng_state: torch.Tensor, live_bytes: int | None = None, fresh: set[int] | None = None
) -> list[str]:
    """Initialize ``module``'s ZeRO-3-partitioned parameters with the model's own init; returns the entry points run.

    ``rng_state`` is ``torch.get_rng_state()`` from just before the model was built: the init draws
    from it, as it would in one process after ``torch.manual_seed`` (the numbers the per-layer
    defaults drew during construction are discarded with those defaults). Parameters built outside
    ``zero.Init`` keep their values. Ranks whose ``rng_state`` differs take rank 0's seed (:func:`agree_on_seed`).

    ``fresh``: ids of the tensors :func:`lightning_llm.parallel.init.zero3_build.partition_meta_model` created from the
    meta device (they hold no values): modules owning them with no init entry point are refused by name.

    Example::

        state = torch.get_rng_state()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Llama(config)          # partitioned, Llama.reset_parameters lost
        initialize_partitioned(model, state)
    """
    fresh = fresh or set()
    entries = init_entry_points(module, pending=lambda t: id(t) in fresh or is_partitioned(t), strict=bool(fresh))
    if not entries:
        return []
    params = list({id(p): p for p in module.parameters() if is_partitioned(p)}.values())
    placeholders = [p.data for p in params]
    torch.set_rng_state(rng_state)
    agree_on_seed()  # ranks whose generators differ (not seeded alike) take rank 0's seed, logged once
    gather = _GatherOnTouch(params, LIVE_BYTES if live_bytes is None else live_bytes)
    try:
        for param in params:
            _show_full_shape(param)
        with torch.no_grad(), gather:
            for _, init in entries:
                init()
    finally:
        gather.release_all()
        for param, placeholder in zip(params, placeholders):
            param.data = placeholder  # DeepSpeed's empty stand-in of a partitioned parameter
        materialize._scratch.clear()
    return [name for name, _ in entries]
