"""Per-block activation memory: the bytes each transformer block keeps for backward.

Two ways to measure the same three numbers per block (:class:`BlockActivations`):

* :func:`measure_blocks` runs one real forward of the model (``measure_fn()``, e.g. a training
  step's loss computation). Saved tensors are counted and then dropped at once, so the pass holds
  at most one block's activations: cheap on CPU and safe on a GPU that could not hold them all.
  It works on blocks already split by tensor parallelism (local shards are counted).
* :func:`measure_block_activations` runs the forward under ``FakeTensorMode`` with the
  parameters swapped for fake copies: nothing is allocated, and a model on the meta device works.

Counting: a ``saved_tensors_hooks`` pack hook sees every tensor autograd keeps; storages are
counted once per block and parameters not at all. The "op" number (selective checkpointing by
operator) adds the block's input to the outputs of the ops the selective policy saves, seen by a
``TorchDispatchMode``; that is what torch's selective checkpoint caches. The private pieces used
(FakeTensorMode, StorageWeakRef, stateless reparametrization) are confined to this file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class BlockActivations:
    """Bytes one block keeps for backward under each policy.

    Attributes:
        saved: without checkpointing (everything autograd saves).
        input: with full checkpointing (only the block's input, its first tensor argument).
            Other tensor arguments (rotary tables, masks) are shared by all blocks and counted in none.
        op: with selective per-operator checkpointing (input + outputs the policy saves);
            ``None`` when not measured.
    """

    saved: int
    input: int
    op: int | None = None


class _Dropped:
    """Stands in for a saved tensor in a measuring pass that never runs backward."""


def _local(t: torch.Tensor) -> torch.Tensor:
    # The shard itself, without to_local()'s autograd node (this runs inside autograd's pack hook).
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(_local(t).untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().nbytes()


class _BlockTally:
    """Per-block byte counts, filled by hooks while a forward runs."""

    def __init__(self, num_blocks: int, params: Sequence[torch.Tensor], keep: bool) -> None:
        self.current: int | None = None
        self.keep = keep  # False: hand autograd a stand-in, so the pass holds one block's activations at most
        self.params = {_storage(p) for p in params}
        self.saved, self.input, self.op = [0] * num_blocks, [0] * num_blocks, [0] * num_blocks
        self.ran = [False] * num_blocks
        self._shared: set[StorageWeakRef] = set()
        # Tensors counted in the running block, held so that their storages' weak refs stay unique.
        self._saved: dict[StorageWeakRef, torch.Tensor] = {}
        self._op: dict[StorageWeakRef, torch.Tensor] = {}

    def enter(self, index: int, args: tuple, kwargs: dict) -> None:
        self.current, self._saved, self._op = index, {}, {}
        self.ran[index] = True
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        hidden = tensors[0] if tensors else None
        # Other inputs (rotary tables, masks) are the model's, shared by every block: counted in none.
        self._shared = {_storage(t) for t in tensors[1:]} - ({_storage(hidden)} if tensors else set())
        if hidden is not None:
            self.input[index] = _local(hidden).numel() * _local(hidden).element_size()
            self.op[index] = self.input[index]
            self._op[_storage(hidden)] = hidden

    def leave(self) -> None:
        self.current, self._saved, self._op = None, {}, {}

    def pack(self, t: torch.Tensor):
        ref = _storage(t)
        if self.current is not None and ref not in self.params and ref not in self._shared and ref not in self._saved:
            self._saved[ref] = t
            self.saved[self.current] += _nbytes(t)
        return t if self.keep else _Dropped()

    def op_output(self, out) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in self._op:
                self._op[_storage(t)] = t
                self.op[self.current] += _nbytes(t)

    def result(self, with_op: bool) -> list[BlockActivations]:
        return [BlockActivations(s, i, o if with_op else None) for s, i, o in zip(self.saved, self.input, self.op)]


class _SavedOutputs(TorchDispatchMode):
    """Counts the outputs of the ops a selective checkpointing policy would save."""

    def __init__(self, tally: _BlockTally, saves_output: Callable) -> None:
        super().__init__()
        self.tally, self.saves_output = tally, saves_output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tally.current is not None and self.saves_output(func):
            self.tally.op_output(out)
        return out


def _unpack(_packed):
    raise RuntimeError("A forward run to measure activation memory cannot be differentiated.")


@contextmanager
def _counting(blocks: Sequence[nn.Module], tally: _BlockTally, saves_output: Callable | None):
    with ExitStack() as stack:
        for index, block in enumerate(blocks):
            pre = block.register_forward_pre_hook(lambda m, a, k, i=index: tally.enter(i, a, k), with_kwargs=True)
            post = block.register_forward_hook(lambda m, a, o: tally.leave())
            stack.callback(pre.remove)
            stack.callback(post.remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(tally.pack, (lambda t: t) if tally.keep else _unpack))
        stack.enter_context(torch.enable_grad())
        if saves_output is not None:
            stack.enter_context(_SavedOutputs(tally, saves_output))
        yield


def measure_blocks(
    blocks: Sequence[nn.Module], measure_fn: Callable[[], object], saves_output: Callable | None = None
) -> list[BlockActivations]:
    """Measure each block during one real call of ``measure_fn()`` (a forward of the model holding ``blocks``).

    The pass keeps no activations beyond the block that is running; its result is discarded and
    it cannot be differentiated. ``saves_output(op) -> bool`` is the selective policy's choice of
    ops to save; without it ``op`` is not measured.

    Example::

        sizes = measure_blocks(model.layers, lambda: model(tokens).sum())
    """
    params = [p for block in blocks for p in block.parameters()]
    tally = _BlockTally(len(blocks), params, keep=False)
    with _counting(blocks, tally, saves_output):
        measure_fn()
    missed = [i for i, ran in enumerate(tally.ran) if not ran]
    if missed:
        raise RuntimeError(
            f"measure_fn() ran no forward through blocks {missed}; it must run one forward of the model holding "
            "these blocks (e.g. lambda: module.training_step(batch, 0))."
        )
    return tally.result(saves_output is not None)


def measure_block_activations(
    module: nn.Module, blocks: Sequence[nn.Module], step: Callable[[], object], saves_output: Callable | None = None
) -> list[BlockActivations]:
    """Run ``step()`` (one forward of ``module`` on a real-shaped batch) on fake tensors and measure each block.

    ``step`` is called inside the fake mode; tensors it creates from real data are converted on
    the fly. Example::

        sizes = measure_block_activations(module, list(blocks), lambda: module.training_step(batch, 0))
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_params = {n: mode.from_tensor(p, static_shapes=True) for n, p in module.named_parameters(remove_duplicate=False)}
    for name, param in module.named_parameters(remove_duplicate=False):
        fake_params[name].requires_grad_(param.requires_grad)
    tally = _BlockTally(len(blocks), list(fake_params.values()), keep=True)
    with ExitStack() as stack:
        stack.enter_context(_reparametrize_module(module, fake_params, tie_weights=True))
        stack.enter_context(mode)
        stack.enter_context(_counting(blocks, tally, saves_output))
        step()
    return tally.result(saves_output is not None)


@contextmanager
def silenced_logging(module):
    """``self.log`` does nothing inside (a measuring forward must not log fake values)."""
    original = module.log
    module.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        module.log = original


def example_batch(trainer, device: torch.device):
    """One real-shaped training batch, read from the dataset without touching the sampler's position."""
    loader = trainer.datamodule.train_dataloader() if trainer.datamodule is not None else None
    if loader is None:
        loader = trainer.fit_loop._data_source.dataloader()  # dataloaders passed straight to fit()
    dataset, size = loader.dataset, loader.batch_size
    if size is None or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            "activation_checkpointing='auto' measures one batch from a map-style dataset with a batch_size; "
            "this DataLoader has neither. Choose 'full' or 'selective' instead."
        )
    batch = loader.collate_fn([dataset[i] for i in range(size)])
    return _to_device(batch, device)


def _to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def device_memory(device: torch.device) -> int:
    """Total memory of the accelerator, or of the host for CPU training."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    import psutil

    return psutil.virtual_memory().total
