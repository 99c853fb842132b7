"""The planner's activation bytes per checkpointing policy against what torch's MemTracker measures.

``model_footprint`` plans on fake tensors (no allocation); the oracle is one real training step of the same
model under each policy, tracked by ``torch.distributed._tools.mem_tracker.MemTracker``: the peak of its
activation and temporary bytes (gradients are allocated beforehand, so they are not part of that peak).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.parallel.activation_checkpointing import ACOptions, apply_activation_checkpointing
from lightning_llm.strategies.zero_auto import model_footprint

BATCH = 4
POLICIES = {
    "none": ({"mode": "none"}, "none", None),
    "selective-op": ({"mode": "selective", "selective": "op"}, "selective", ACOptions(selective="op")),
    "selective-layer": (
        {"mode": "selective", "selective": "layer", "every_n_layers": 2},
        "selective",
        ACOptions(selective="layer", every_n_layers=2),
    ),
    "full": ({"mode": "full"}, "full", None),
}


def _model(seq_len: int) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("small", n_layers=4, max_seq_len=max(seq_len, 512)))
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    return module


def _measured_activations(module: CausalLM, batch: torch.Tensor) -> int:
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        module.training_step(batch, 0).backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return sum(v for k, v in peak.items() if any(c in str(k) for c in ("ACT", "TEMP")))


@pytest.mark.parametrize("seq_len", [128, 256, 512])
def test_planned_activations_are_within_15_percent_of_measured_for_every_policy(seq_len):
    batch = torch.randint(0, 256, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(1))
    planned = {}
    for label, (apply, mode, options) in POLICIES.items():
        footprint = model_footprint(_model(seq_len), micro_batch_size=BATCH, seq_len=seq_len, ac_options=options)
        module = _model(seq_len)
        apply_activation_checkpointing(find_blocks(module)[1], **apply)
        planned[label] = footprint.activations_for(mode)
        measured = _measured_activations(module, batch)
        assert 0.85 <= planned[label] / measured <= 1.15, (label, planned[label], measured)
    # "selective" is planned by its policy, no longer at the "none" value
    assert planned["full"] < planned["selective-layer"] < planned["none"]
    assert planned["selective-op"] < 0.8 * planned["none"]
