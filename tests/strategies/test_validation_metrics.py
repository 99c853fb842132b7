"""A model built on the meta device by the strategy validates as one process does: its torchmetrics metrics survive
the materialization.

The strategy allocates a meta-built model with ``to_empty`` and replays its initialization. The LightningModule's
torchmetrics metrics (``CausalLM.val_loss`` is a ``MeanMetric``) hold real state tensors that ``to_empty`` would
leave uninitialized, so the first validation's mean started from whatever the memory held (val_loss of -5.8e8 or
5e9 in the CLI's tiny runs). Here the tiny dense model under ZeRO 3 and the tiny MoE under ep2 x ZeRO 3, each built
inside ``validate`` on 2 ranks, must report the val_loss one process computes with the same weights (gathered from
the ranks into an eagerly built model), within 1e-5 relative, over the same 8 sequences.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import run_distributed
from tests.strategies._parity import full_state

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CASES = {"tiny": {"zero_stage": 3}, "tiny-moe": {"expert_parallel_size": 2, "zero_stage": 3}}
TOKENS = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(5))


def _val_loss(preset: str, strategy=None, devices: int = 1, state: dict | None = None) -> tuple[float, dict]:
    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name(preset, vocab_size=256, n_layers=2))
    if state is not None:  # one process, eagerly built, holding the sharded run's weights
        module.configure_model()
        module.load_state_dict(state)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy or "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(module, DataLoader(TOKENS, batch_size=2), verbose=False)
    return metrics["val_loss"], full_state(module)


def _sharded() -> dict[str, float]:
    from lightning_llm.strategies import LLMParallelStrategy

    return {preset: _val_loss(preset, LLMParallelStrategy(**kwargs), devices=2) for preset, kwargs in CASES.items()}


def test_meta_built_models_validate_as_one_process():
    got = run_distributed(_sharded, 2, timeout=240)
    for preset in CASES:
        want, _ = _val_loss(preset, state=got[0][preset][1])
        assert 5.0 < want < 6.0  # untrained: near ln(256) = 5.55
        for rank, results in enumerate(got):
            assert results[preset][0] == pytest.approx(want, rel=1e-5), (preset, rank, results[preset][0], want)
