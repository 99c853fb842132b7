"""Per-rank bytes of parameters, gradients and optimizer state, measured in a real training step.

Used by the memory planner's tests and ``benchmarks/zero_memory.py``: sums the bytes of the tensors
each rank holds (local shards of DTensors) right after the optimizer step, and the parameters held
between forward and backward (what stays gathered).
"""

from __future__ import annotations

import lightning as L
import torch

from lightning_llm.data import LLMDataModule
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.models import CausalLM
from lightning_llm.parallel.dtensor import local_tensor
from lightning_llm.testing.trainer import cpu_trainer


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = local_tensor(t)
        total += t.numel() * t.element_size()
    return total


class _Measure(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        # When a block's forward starts, FSDP2's own pre-forward hook (registered first) has gathered
        # it: the parameters at their fullest.
        self.params_peak = 0
        for block in find_blocks(pl_module)[1].children():
            block.register_forward_pre_hook(self._record_peak)

    def _record_peak(self, module, args):
        self.params_peak = max(self.params_peak, _local_bytes(self._module.parameters()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._module = pl_module

    def on_before_backward(self, trainer, pl_module, loss):
        # Between forward and backward: what FSDP2 keeps gathered (stages 1-2 keep every block).
        self.params_in_backward = _local_bytes(pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = list(pl_module.parameters())
        states = [
            v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
        ]
        self.bytes = {
            "params": _local_bytes(params),
            "grads": _local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _local_bytes(states),
            "params_in_backward": self.params_in_backward,
            "params_peak": max(self.params_peak, self.params_in_backward),
        }


def measure_model_states(world_size: int, preset: str, zero_stage: int, seq_len: int = 32) -> dict:
    """Bytes on this rank after one step of ``CausalLM(preset)`` under ``LLMParallelStrategy(zero_stage)``."""
    from lightning_llm.strategies import LLMParallelStrategy

    torch.manual_seed(0)
    measure_cb = _Measure()
    trainer = cpu_trainer(
        devices=world_size,
        strategy=LLMParallelStrategy(zero_stage=zero_stage),
        max_steps=1,
        callbacks=[measure_cb],
        limit_val_batches=0,
    )
    model = CausalLM(preset, warmup_steps=1)
    trainer.fit(model, LLMDataModule(num_tokens=20_000, seq_len=seq_len, batch_size=2))
    return measure_cb.bytes


def step_peak(module: L.LightningModule, optimizer: torch.optim.Optimizer, batch, fsdp_root=None) -> int:
    """Peak bytes on the CPU of one real training step (``training_step``, backward, optimizer step), after a first
    step created the optimizer state, as in every step but the first. Measured by torch's ``MemTracker``, or its
    ``FSDPMemTracker`` for a model sharded by FSDP2 from ``fsdp_root`` (it also attributes FSDP's buffers).

    Example::

        peak = step_peak(module, torch.optim.AdamW(module.parameters()), batch)
    """
    from lightning_llm._compat.torch import memory_trackers

    MemTracker, FSDPMemTracker = memory_trackers()

    def step():
        module.training_step(batch, 0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()
    if fsdp_root is None:
        tracker = MemTracker()
        tracker.track_external(module, optimizer)
    else:
        tracker = FSDPMemTracker(fsdp_root, optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
