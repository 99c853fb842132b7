"""A module called from several blocks (Zamba's shared attention, ALBERT's shared layer) is sharded once.

The model: a user-style GPT of 3 blocks whose attention is one module object called from every block, each block
keeping its own norms and MLP (the per-layer adapters). Under data parallelism the shared module becomes an FSDP2
unit of its own, gathered for each call; under tensor parallelism it is split once (its head count divided once).
Trained in fp32 on 2 gloo ranks under ZeRO 0, ZeRO 3, ZeRO 3 with full activation checkpointing, tp2 and tp2 + SP it
must match one process (per-step loss and every parameter within 1e-5); saved mid-run under ZeRO 3 and tp2 and
resumed in a fresh model, it must continue as the straight run (within 1e-6). Pipeline parallelism (blocks on different
ranks), blocks without a model holding them, and one tensor held by two blocks' own modules are refused before
training, by name.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_llm.modeling.tied import modules_shared_by_blocks
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from lightning_llm.testing.models import UserLM, _NextTokenModule
from tests.strategies import _parity

pytestmark = [pytest.mark.distributed]

LAYOUTS = {
    "zero0": {"zero_stage": 0},
    "zero3": {"zero_stage": 3},
    "zero3_ac_full": {"zero_stage": 3, "activation_checkpointing": "full"},
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
}


class SharedAttentionLM(_NextTokenModule):
    """UserLM (held as ``self.model``) with one attention module shared by all its blocks."""

    def __init__(self, hold_model: bool = True) -> None:
        super().__init__(learning_rate=0.5)
        torch.manual_seed(0)
        model = UserLM(layers=3)
        for block in model.blocks[1:]:
            block.attn = model.blocks[0].attn
        if hold_model:
            self.model = model
        else:  # the blocks and the rest as direct children of the LightningModule
            self.embed, self.pos, self.blocks, self.ln_f, self.head = (
                model.embed, model.pos, model.blocks, model.ln_f, model.head,
            )  # fmt: skip
            self._forward = model.forward.__func__

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens) if hasattr(self, "model") else self._forward(self, tokens)


def _train(layouts: list[str], root: str) -> dict:
    results = {}
    for layout in layouts:
        strategy = LLMParallelStrategy(**LAYOUTS[layout])
        dp = 2 // LAYOUTS[layout].get("tensor_parallel_size", 1)
        model = SharedAttentionLM()
        losses, params = _parity.train("user", strategy, devices=2, dp=dp, model=model)
        results[layout] = (losses, params, {block.attn.num_heads for block in model.model.blocks})
    for layout in RESUMED:  # saved at step SAVE_AT from inside the loop, resumed in a fresh model to the end
        dp = 2 // LAYOUTS[layout].get("tensor_parallel_size", 1)
        path = Path(root) / f"{layout}.ckpt"
        first, _ = _parity.train(
            "user", LLMParallelStrategy(**LAYOUTS[layout]), 2, dp, model=SharedAttentionLM(), steps=SAVE_AT,
            save_to=path,
        )  # fmt: skip
        rest, params = _parity.train(
            "user", LLMParallelStrategy(**LAYOUTS[layout]), 2, dp, model=SharedAttentionLM(), resume_from=path
        )
        results[f"{layout} resumed"] = (first + rest, params)
    for label, kwargs, dp, model in (
        ("pp2", {"pipeline_parallel_size": 2, "num_microbatches": 2}, 1, SharedAttentionLM()),
        ("no model attribute", {"zero_stage": 3}, 2, SharedAttentionLM(hold_model=False)),
    ):
        try:
            _parity.train("user", LLMParallelStrategy(**kwargs), devices=2, dp=dp, model=model)
            results[label] = "not refused"
        except ValueError as error:
            results[label] = str(error)
    return results


RESUMED = ["zero3", "tp2"]
SAVE_AT = 4
_runs: list = []


def _results() -> dict:
    if not _runs:
        with tempfile.TemporaryDirectory() as root:
            _runs.append(run_distributed(_train, 2, list(LAYOUTS), root, timeout=400)[0])
    return _runs[0]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_shared_module_is_sharded_once_and_trains_as_one_process(layout):
    losses, params, heads = _results()[layout]
    model = SharedAttentionLM()
    # Split once under tensor parallelism: each rank runs half the heads (divided twice it would run a quarter).
    assert heads == {model.model.blocks[0].attn.num_heads // LAYOUTS[layout].get("tensor_parallel_size", 1)}
    want = _parity.train("user", model=model)
    assert torch.equal(want[1]["model.blocks.0.attn.query.weight"], want[1]["model.blocks.2.attn.query.weight"])
    _parity.assert_parity((losses, params), want, f"shared attention {layout}", rtol=1e-5)


@pytest.mark.timeout(450)
@pytest.mark.parametrize("layout", RESUMED)
def test_a_shared_module_saved_and_resumed_continues_as_the_straight_run(layout):
    """Saved under every block's path (``state_dict`` lists a shared module at each), loaded back into the one
    module."""
    straight, resumed = _results()[layout][:2], _results()[f"{layout} resumed"]
    _parity.assert_parity(resumed, straight, f"shared attention {layout} resumed at step {SAVE_AT}", rtol=1e-6)


@pytest.mark.timeout(450)
def test_layouts_that_cannot_shard_it_once_are_refused_by_name():
    results = _results()
    assert "model.blocks.0.attn (_UserAttention) is one module called from 3 blocks" in results["pp2"], results
    assert "Train this model with tensor or data parallelism (ZeRO 0-3)" in results["pp2"]
    assert "Hold the model in one attribute of the LightningModule" in results["no model attribute"], results


def test_shared_modules_are_found_and_a_tensor_tied_across_blocks_is_refused():
    blocks = UserLM(layers=3).blocks
    assert modules_shared_by_blocks(list(blocks), ["b.0", "b.1", "b.2"]) == []
    blocks[2].attn = blocks[0].attn
    found = modules_shared_by_blocks(list(blocks), ["b.0", "b.1", "b.2"])
    assert [(m is blocks[0].attn, places) for m, places in found] == [(True, ["b.0.attn", "b.2.attn"])]
    blocks[1].fc_in.weight = nn.Parameter(torch.empty(0))
    blocks[2].fc_in.weight = blocks[1].fc_in.weight
    with pytest.raises(ValueError, match=r"one tensor held by the blocks \['b.1', 'b.2'\] in modules of their own"):
        modules_shared_by_blocks(list(blocks), ["b.0", "b.1", "b.2"])
