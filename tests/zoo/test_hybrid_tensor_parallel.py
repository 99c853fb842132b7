"""Hybrid stacks under tensor (+ sequence) parallelism: plans merged per block class, coverage refused, then reported.

Jamba (Mamba blocks with MoE feed-forwards beside attention blocks), DeepSeek-V3 (latent attention; a dense block
then MoE blocks) and a user's ``nn.Sequential`` of convolution and attention blocks train under tp2 and tp2+SP
against one process (fp32, per-step loss and every parameter within 1e-5, every parameter identical on the ranks
holding it), with no plan entry. Jamba's Mamba mixers (one input projection cut into five parts, a depthwise
convolution) and the user's gated convolution blocks are kept whole and reported as replicated; the user's fused
``[k | v]`` projection is split per part, its layout read off the ``chunk`` in its forward. The mixers kept whole
see the whole sequence under sequence parallelism, and everything else is split: each
rank holds at most 55% of the attention and of the expert parameters (DeepSeek-V3's latent attention keeps its
low-rank down-projections whole; see tests/zoo/test_attention_variants.py for its share at realistic ranks).
"""

from __future__ import annotations

import pytest

from lightning_llm.modeling.blocks import block_kind, find_blocks
from lightning_llm.parallel.parallelize import plan_tensor_parallel
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity
from tests.zoo._harness import train
from tests.zoo._models import ZooLM
from tests.zoo._models_hybrid import register

MODELS = ["jamba", "deepseek_v3", "user_sequential"]
# Parameter groups whose largest per-rank share is asserted (DeepSeek-V3's tiny latent ranks: see the docstring).
CHECKED_SHARES = {"jamba": ("attention", "experts"), "deepseek_v3": ("experts",), "user_sequential": ()}
LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}}

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
_runs: dict = {}
_references: dict = {}


def _train_all(layouts: list[str], models: list[str]) -> dict:
    import traceback

    import torch.distributed as dist

    from lightning_llm.strategies import LLMParallelStrategy

    register()
    results: dict = {}
    for layout in layouts:
        for name in models:
            strategy = LLMParallelStrategy(**LAYOUTS[layout])
            try:
                results[(layout, name)] = (train(name, strategy, devices=2), strategy.tensor_parallel_coverage)
            except Exception as error:
                results[(layout, name)] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}"
    return results if dist.get_rank() == 0 else None


def _result(layout: str, name: str):
    if not _runs:
        _runs.update(run_distributed(_train_all, 2, list(LAYOUTS), MODELS, timeout=840)[0])
    return _runs[(layout, name)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hybrid_stack_under_tensor_parallel_matches_single_process(layout, name):
    result = _result(layout, name)
    assert not isinstance(result, str), f"{name} under {layout} failed:\n{result}"
    (losses, params, differing, _, held), coverage = result
    if name not in _references:
        register()
        _references[name] = train(name)
    ref_losses, ref_params, *_ = _references[name]
    assert not differing, f"{name} {layout}: parameters differ between ranks holding them: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), f"{name} {layout}", rtol=1e-5, loss_rtol=1e-5)
    for group in CHECKED_SHARES[name]:
        assert held[group] <= 0.55, f"{name} {layout}: a rank holds {held[group]:.0%} of the {group} parameters"
    assert len(coverage) == len({block_kind(b) for b in find_blocks(ZooLM(name))[1]}), coverage  # a line per kind
    if name == "user_sequential":  # its attention is computed in the block's forward: q/kv split, o row-wise
        attention_line = next(line for line in coverage if line.startswith("_Attention"))
        assert "q_proj 50%/rank" in attention_line and "kv_proj 50%/rank" in attention_line, attention_line
    if name == "jamba":
        mamba_line = next(line for line in coverage if line.startswith("JambaMambaDecoderLayer"))
        assert "feed_forward.experts 50%/rank" in mamba_line and "replicated: mamba" in mamba_line, mamba_line


@pytest.mark.timeout(120)
def test_a_user_stack_needs_no_plan_entry_convolution_blocks_whole_and_a_fused_kv_read_off_its_chunk():
    register()
    module = ZooLM("user_sequential")
    blocks_name, blocks = find_blocks(module)
    plan, _ = plan_tensor_parallel(module, tp=2, blocks_name=blocks_name, blocks=blocks, user_plan=None)
    assert plan["model.layers.*.kv_proj"] == "fused_colwise:32,32"  # [k | v], chunk(2, dim=-1) in the forward
    for part in ("in_proj", "conv", "out_proj"):  # the gated convolution blocks (0 and 2) stay whole
        assert plan[f"model.layers.*.{part}"] == "replicate"


@pytest.mark.timeout(120)
def test_state_space_mixers_inside_blocks_are_kept_whole_without_a_plan_entry():
    register()
    module = ZooLM("jamba")
    blocks_name, blocks = find_blocks(module)
    plan, _ = plan_tensor_parallel(module, tp=2, blocks_name=blocks_name, blocks=blocks, user_plan=None)
    assert plan["model.model.layers.*.mamba"] == "replicate"
    assert not any(name.startswith("model.model.layers.*.mamba.") for name in plan), plan
