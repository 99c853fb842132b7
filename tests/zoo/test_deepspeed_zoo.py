"""The architecture mechanisms under DeepSpeed ZeRO-3 (``LLMDeepSpeedStrategy``) against one process.

One model per mechanism DeepSpeed's parameter partitioning could trip on: stacked 3-D experts (Mixtral), tied
embeddings (Gemma 3), latent attention with shared experts and a dense first block (DeepSeek-V3), a hybrid Mamba +
attention stack with MoE beside dense MLPs (Jamba), ALiBi (BLOOM), per-head attention sinks (gpt-oss), linear
attention beside attention (Qwen3-Next) and one module per expert in a ModuleList (litgpt's LLaMAMoE). Each trains
the zoo's steps in fp32 on 2 gloo ranks with every parameter partitioned
(``stage3_param_persistence_threshold=0``); per-step loss and every parameter (gathered) within 1e-5 relative of the
same model, data and seed trained by one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_llm.testing import cpu_trainer, run_distributed
from tests._optional import requires_deepspeed
from tests.strategies._parity import GlobalLoss, assert_parity
from tests.zoo._harness import GLOBAL_BATCH, tokens
from tests.zoo._models import ZooLM
from tests.zoo._models_hybrid import register
from tests.zoo._models_more import register as register_more

pytestmark = [pytest.mark.distributed, requires_deepspeed, pytest.mark.timeout(600)]
pytest.importorskip("transformers")

MODELS = [
    "mixtral",
    "gemma3",
    "deepseek_v3",
    "jamba",
    "bloom_alibi",
    "gpt_oss_sinks",
    "qwen3_next",
    "litgpt_moe",
]
LAYOUTS = {
    "deepspeed_zero3": {"zero_stage": 3, "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
}


def _train(name: str, strategy=None, devices: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    import tests.zoo._models_attention  # noqa: F401  (registers bloom_alibi, gpt_oss_sinks)

    register()
    register_more()
    model, losses = ZooLM(name), GlobalLoss()
    trainer = cpu_trainer(devices=devices, strategy=strategy or "auto", max_steps=4, callbacks=[losses])
    sampler = None if strategy is not None else DistributedSampler(tokens(), num_replicas=1, rank=0, shuffle=True)
    trainer.fit(model, DataLoader(tokens(), batch_size=GLOBAL_BATCH // devices, sampler=sampler))
    if strategy is None:
        return losses.losses, {k: v.detach().clone() for k, v in model.named_parameters()}
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return losses.losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_all() -> dict | None:
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    results = {name: _train(name, LLMDeepSpeedStrategy(**LAYOUTS["deepspeed_zero3"]), devices=2) for name in MODELS}
    return results if dist.get_rank() == 0 else None


_results: dict = {}


@pytest.mark.parametrize("name", MODELS)
def test_mechanism_trains_under_deepspeed_zero3_as_one_process(name):
    if not _results:
        _results.update(run_distributed(_train_all, 2, timeout=560)[0])
    got, want = _results[name], _train(name)
    assert_parity(got, want, f"{name} deepspeed_zero3", rtol=1e-5, loss_rtol=1e-5)
