"""Lightning's own strategies on CPU ranks, as checkpoint sources for the resume tests.

Lightning refuses ``FSDPStrategy`` on a CPU accelerator (its connector checks the exact class) and hands FSDP1 the
CUDA index of its root device, ``None`` on CPU, which FSDP1 takes as "find an accelerator". :class:`CpuFSDP` passes
``device_id=cpu`` itself and turns off the CPU offload of full state dicts (a copy from CPU to CPU that crashes
FSDP1 on CPU); what it saves is ``FSDPStrategy``'s own checkpoint, written by Lightning's code. Lightning's
``DeepSpeedStrategy`` refuses CPU too: ``LLMDeepSpeedStrategy`` is that class with a CPU path, saving through
Lightning's ``DeepSpeedStrategy.save_checkpoint``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.models.llama import TransformerBlock
from tests._optional import HAS_DEEPSPEED
from tests.strategies._parity import STEPS


class CpuFSDP(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU ranks (see the module docstring); each block its own FSDP unit."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kwargs = {k: v for k, v in self.kwargs.items() if k != "auto_wrap_policy"}
        wrapped = FullyShardedDataParallel(
            model,
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
            sharding_strategy=self.sharding_strategy,
            **kwargs,
        )
        return super()._setup_model(wrapped)  # already wrapped: Lightning keeps it

    def lightning_module_state_dict(self):
        with _no_cpu_offload():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer):
        with _no_cpu_offload():
            return super().optimizer_state(optimizer)


@contextlib.contextmanager
def _no_cpu_offload() -> Iterator[None]:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def context(module, world_size, rank0_only=True):
        model = FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
        optimizer = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
        return FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, model, optimizer)

    with mock.patch("lightning.pytorch.strategies.fsdp._get_full_state_dict_context", context):
        yield


class HandShardedLM(CausalLM):
    """The reference model as a ``ModelParallelStrategy`` user writes it: FSDP2 applied by hand in
    ``configure_model`` over the strategy's data-parallel mesh (built eagerly from seed 0, as ``make_model``)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(LlamaConfig.from_name("tiny", n_layers=2), warmup_steps=2, max_steps=STEPS)
        super().configure_model()
        self._sharded = False

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if not self._sharded:
            self._sharded = True
            for layer in self.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])


def source_strategy(name: str):
    """A fresh strategy for a source of :data:`SOURCES` (2 ranks)."""
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    return {
        "ddp": lambda: DDPStrategy(),
        "fsdp_full": lambda: CpuFSDP(state_dict_type="full"),
        "fsdp_sharded": lambda: CpuFSDP(state_dict_type="sharded"),
        "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "deepspeed": lambda: LLMDeepSpeedStrategy(zero_stage=2),
        "deepspeed_zero3": lambda: LLMDeepSpeedStrategy(zero_stage=3),
    }[name]()


SOURCES = [
    "ddp",
    "fsdp_full",
    "fsdp_sharded",
    "model_parallel",
    *(["deepspeed", "deepspeed_zero3"] if HAS_DEEPSPEED else []),
]
