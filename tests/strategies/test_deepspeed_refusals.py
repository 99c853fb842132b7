"""Optimizers DeepSpeed cannot run are refused before the first step, naming what works instead."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.optim import ShardedMuon
from lightning_llm.strategies.deepspeed_checks import refuse_matrix_optimizers


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs a newer torch")
def test_muon_is_refused_naming_the_strategies_where_it_works():
    weight = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"torch\.optim\.Muon cannot run under LLMDeepSpeedStrategy.*ShardedMuon"):
        refuse_matrix_optimizers(torch.optim.Muon([weight]))
    with pytest.raises(ValueError, match=r"lightning_llm\.optim\.ShardedMuon cannot run under LLMDeepSpeed"):
        refuse_matrix_optimizers(ShardedMuon([weight]))
    refuse_matrix_optimizers(torch.optim.AdamW([weight]))  # what DeepSpeed runs passes
