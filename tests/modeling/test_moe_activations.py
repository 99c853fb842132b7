"""Activation measurement of Hugging Face MoE models, whose grouped_mm has no fp32 fake kernel."""

import pytest
import torch

from lightning_llm.modeling.activations import (
    activation_bytes,
    measure_activations,
    measure_block_activations,
    measure_blocks,
)
from tests.zoo._models import ZooLM


def test_real_weights_fall_back_to_one_real_forward_and_meta_weights_refuse():
    module = ZooLM("mixtral")
    blocks, batch = list(module.model.model.layers), torch.zeros(2, 16, dtype=torch.long)
    step = lambda: module.training_step(batch, 0)  # noqa: E731
    with pytest.raises(RuntimeError, match="BF16"):  # why the fallback exists
        measure_block_activations(module, blocks, step)
    assert measure_activations(module, blocks, step) == measure_blocks(blocks, step)
    # Twice the batch keeps about twice the activations (expert buckets vary a little with routing).
    twice, once = (activation_bytes(module, micro_batch_size=b, seq_len=15) for b in (4, 2))
    assert twice == pytest.approx(2 * once, rel=1e-3)
    with torch.device("meta"):
        on_meta = ZooLM("mixtral")
    with pytest.raises(RuntimeError, match="BF16"):
        activation_bytes(on_meta, micro_batch_size=2, seq_len=15)
