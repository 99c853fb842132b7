"""Per-block activation memory, measured on fake tensors: nothing is allocated.

One training step's forward runs under ``FakeTensorMode`` with the module's parameters swapped for
fake copies; a saved-tensors hook records, for each transformer block, the bytes autograd keeps for
backward (storages counted once, parameters excluded) and the bytes of the block's input (what a
checkpointed block keeps instead). The private pieces used (FakeTensorMode, StorageWeakRef) are
confined to this file.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module


@dataclass
class BlockActivations:
    """Bytes one block keeps for backward without checkpointing, and its input's bytes."""

    saved: int
    input: int


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def measure_block_activations(module: nn.Module, blocks: list[nn.Module], step: Callable[[], object]) -> list[BlockActivations]:
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
    param_storages = {StorageWeakRef(p.untyped_storage()) for p in fake_params.values()}
    current: list[int | None] = [None]
    seen: list[set] = [set() for _ in blocks]
    saved = [0] * len(blocks)
    inputs = [0] * len(blocks)

    def pack(t: torch.Tensor):
        index = current[0]
        if index is not None:
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in param_storages and ref not in seen[index]:
                seen[index].add(ref)
                saved[index] += _nbytes(t)
        return t

    def enter(index):
        def hook(_module, args, kwargs):
            current[0] = index
            hidden = args[0] if args else next(iter(kwargs.values()))
            inputs[index] = hidden.numel() * hidden.element_size()

        return hook

    def leave(_module, _args, _output):
        current[0] = None

    with ExitStack() as stack:
        for index, block in enumerate(blocks):
            stack.callback(block.register_forward_pre_hook(enter(index), with_kwargs=True).remove)
            stack.callback(block.register_forward_hook(leave).remove)
        stack.enter_context(_reparametrize_module(module, fake_params, tie_weights=True))
        stack.enter_context(mode)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(torch.enable_grad())
        step()
    return [BlockActivations(saved=s, input=i) for s, i in zip(saved, inputs)]


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
