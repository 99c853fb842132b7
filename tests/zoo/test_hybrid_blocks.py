"""Hybrid models without ``blocks=``: found, planned per block, and trained with parity under PP, ZeRO-3 and AC.

Jamba mixes two block classes (Mamba and attention; MoE and dense feed-forwards), DeepSeek-V3 mixes a dense
first block with MoE blocks of the same class, and a user's model holds mixed blocks in an ``nn.Sequential``
(:mod:`tests.zoo._models_hybrid`). The strategy finds their blocks by itself; each is trained 4 steps under
pp2 (1F1B), dp2 ZeRO-3 and dp2 ZeRO-3 with selective activation checkpointing, against one process: per-step
losses and every parameter within 1e-5 relative (fp32). One spawned process group trains every cell.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.modeling.activations import activation_bytes_by_mode, measure_activations
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.repeated_blocks import identical_blocks
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.parallel.pipeline.costs import stage_costs
from lightning_llm.parallel.pipeline.gates import PipelineState, StageChunk, install_gates, outer_modules
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity
from tests.zoo._harness import GLOBAL_BATCH, SEQ_LEN, tokens, train, train_zoo
from tests.zoo._models import ZooLM
from tests.zoo._models_hybrid import HYBRID_MODELS, SequentialHybrid, register

register()

LAYOUTS = ["pp2", "dp2_zero3", "ac_selective"]
BLOCKS = {
    "jamba": ("model.model.layers", ["Mamba", "Attention", "Mamba", "Attention"]),
    "deepseek_v3": ("model.model.layers", ["DecoderLayer"] * 4),
    "user_sequential": ("model.layers", ["ConvMixer", "Attention", "ConvMixer", "Attention"]),
}
# Per block: the query projection's width, 0 for a block without attention (DeepSeek-V3's latent attention has
# no plain query projection, so every block takes the embedding width, as before).
ATTENTION_WIDTHS = {"jamba": [0, 32, 0, 32], "deepseek_v3": [32] * 4, "user_sequential": [0, 32, 0, 32]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_hybrid_blocks_are_found_without_blocks_argument(name):
    module = ZooLM(name)
    found, blocks = find_blocks(module)
    expected_name, kinds = BLOCKS[name]
    assert found == expected_name
    assert all(kind in type(block).__name__ for kind, block in zip(kinds, blocks, strict=True))
    assert not identical_blocks(list(blocks))  # so planning measures every block, not two for all


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_flops_and_stage_costs_count_attention_only_in_attention_blocks(name):
    module = ZooLM(name)
    shape = ModelShape.of(module)
    widths = ATTENTION_WIDTHS[name]
    assert shape.block_attention_widths == widths
    assert shape.flops_per_token(SEQ_LEN) == 6 * shape.matmul_parameters + 12 * sum(widths) * SEQ_LEN
    blocks_name, blocks = find_blocks(module)
    with_seq = stage_costs(module, blocks, *outer_modules(module, blocks_name), seq_len=SEQ_LEN).blocks
    without = stage_costs(module, blocks, *outer_modules(module, blocks_name), seq_len=None).blocks
    assert [a - b for a, b in zip(with_seq, without)] == [12 * w * SEQ_LEN for w in widths]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_activation_planner_measures_each_kind_of_block(name):
    module = ZooLM(name)
    batch = tokens()[:2]
    sizes = measure_activations(module, list(find_blocks(module)[1]), lambda: module.training_step(batch, 0))
    assert len(sizes) == 4 and all(s.saved > 0 for s in sizes)
    none, full = activation_bytes_by_mode(module, micro_batch_size=2, seq_len=SEQ_LEN - 1)
    assert none == sum(s.saved for s in sizes)
    assert full == sum(s.input for s in sizes) + max(s.saved for s in sizes)


def _train_hybrid(layouts: list[str], models: list[str]):
    register()  # in the spawned ranks
    return train_zoo(layouts, models)


_runs: dict = {}
_references: dict = {}


def _run() -> dict:
    if not _runs:
        _runs.update(run_distributed(_train_hybrid, 2, LAYOUTS, HYBRID_MODELS, timeout=840)[0])
    return _runs


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", HYBRID_MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_model_matches_single_process(layout, name):
    result = _run()[layout][name]
    assert not isinstance(result, str), f"{name} under {layout} failed:\n{result}"
    losses, params, differing, *_ = result
    if name not in _references:
        _references[name] = train(name)
    ref_losses, ref_params, *_ = _references[name]
    assert not differing, f"{name} {layout}: parameters differ between ranks holding them: {differing}"
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_diff = max(
        float((params[k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in ref_params.items() if k in params
    )
    print(f"\n{layout:>13} {name:<16} max loss rel diff {loss_diff:.1e}  max param rel diff {param_diff:.1e}")
    assert_parity((losses, params), (ref_losses, ref_params), f"{name} {layout}", rtol=1e-5, loss_rtol=1e-5)
    assert len(losses) == len(ref_losses) == len(tokens()) // GLOBAL_BATCH


@pytest.mark.timeout(60)
def test_a_gated_sequential_runs_the_active_stage_and_passes_other_blocks_through():
    model = SequentialHybrid()
    model.layers[1].layer_type = "full_attention"  # what a hybrid's forward reads to pick a block's mask
    blocks = list(model.layers)
    first, last = StageChunk(0, range(0, 2), True, False), StageChunk(1, range(2, 4), False, True)
    received = torch.randn(2, SEQ_LEN, 32)
    with torch.no_grad():
        expected = blocks[3](blocks[2](received))
        state = PipelineState(chunks=[first, last], num_microbatches=1)
        install_gates(model, "layers", model.layers, {"before": [], "after": []}, state)
        with state.activate(last, received):
            assert model.layers[1].layer_type == "full_attention"  # a block this rank holds, outside the stage
            torch.testing.assert_close(model.layers(torch.zeros_like(received)), expected)
