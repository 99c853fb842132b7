"""Attention variants under tensor parallelism (tp2, tp2 + sequence parallel) against one process.

Each cell trains one tiny Hugging Face model whose attention is not plain multi-head/GQA (multi-query
GPTBigCode, Falcon-7B-style and Llama with one KV head, DeepSeek-V3's multi-head latent attention, Bloom's ALiBi, GptOss's attention sinks, Falcon's
QKV fused per KV group) and asserts, in fp32: per-step losses and every parameter within 1e-5 relative of
the single process, every parameter bit-identical on the ranks that hold it, and each rank holding at most
55% of the attention parameters (local shards over global sizes), so the heads really are split. One
spawned process group trains every model under both layouts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity
from tests.zoo._harness import LAYOUTS, train
from tests.zoo._models_attention import ATTENTION, MODELS, PLANS

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TP_LAYOUTS = ["tp2", "tp2_sp"]
MAX_SHARE = 0.55
_runs: dict = {}
_references: dict = {}


def attention_share(module: nn.Module, attention: str) -> float:
    """This rank's share of the blocks' attention parameters: local shard elements over global elements."""
    _, blocks = find_blocks(module, None)
    params = [p for block in blocks for p in block.get_submodule(attention).parameters()]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return local / sum(p.numel() for p in params)


def train_variants(layouts: list[str], models: list[str]) -> dict:
    """On each rank: {layout: {model: (training result, attention share, sinks' placements) or the error text}}."""
    import traceback

    from lightning_llm.strategies import LLMParallelStrategy

    results = {}
    for layout in layouts:
        world_size, kwargs = LAYOUTS[layout]
        results[layout] = {}
        for name in models:
            strategy = LLMParallelStrategy(**kwargs, tensor_parallel_plan=PLANS.get(name))
            try:
                result = train(name, strategy, devices=world_size)
                module = strategy.lightning_module
                per_head = {n: p.placements for n, p in module.named_parameters() if n.endswith(".sinks")}
                results[layout][name] = (result, attention_share(module, ATTENTION[name]), per_head)
            except Exception as error:
                results[layout][name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}"
    return results


def _run(layout: str) -> list[dict]:
    if not _runs:
        _runs["ranks"] = run_distributed(train_variants, 2, TP_LAYOUTS, MODELS, timeout=840)
    return [rank[layout] for rank in _runs["ranks"]]


def _reference(name: str):
    if name not in _references:
        _references[name] = train(name)
    return _references[name]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_attention_variant_matches_single_process(layout, name):
    ranks = [rank[name] for rank in _run(layout)]
    for result in ranks:
        if isinstance(result, str):
            raise AssertionError(f"{name} under {layout} failed:\n{result}")
    (losses, params, differing, *_), _, per_head = ranks[0]
    ref_losses, ref_params, *_ = _reference(name)
    assert not differing, f"{name} {layout}: parameters differ between ranks holding them: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), f"{name} {layout}", rtol=1e-5, loss_rtol=1e-5)
    assert all(placements == (Shard(0),) for placements in per_head.values()), per_head  # sinks split with heads
    assert (name == "gpt_oss_sinks") == bool(per_head)
    shares = [share for _, share, _ in ranks]
    print(f"{name} {layout}: attention share per rank {[round(s, 4) for s in shares]}")
    assert all(share <= MAX_SHARE for share in shares), f"{name} {layout}: attention share per rank {shares}"


@pytest.mark.timeout(60)
def test_reference_losses_are_finite():
    """The single-process references train (a model the checks above compare with must itself run)."""
    for name in MODELS:
        losses = _reference(name)[0]
        assert len(losses) > 0 and all(torch.isfinite(torch.tensor(losses)))


OTHER_LAYOUTS = ["pp2", "dp2_zero3", "ac_selective"]
# None since the pipeline places what the forward runs before the blocks (Bloom's embedding LayerNorm) on the first
# stage; before, Bloom was refused under pp2 in its first forward.
NOT_SUPPORTED: set = set()
OTHER_CELLS = [(layout, name) for layout in OTHER_LAYOUTS for name in MODELS if (layout, name) not in NOT_SUPPORTED]
_other_runs: dict = {}


def _train_other(layouts: list[str], models: list[str]) -> dict:
    """Only the cells of OTHER_CELLS: a cell that fails on one rank only would leave the next collective hanging."""
    from tests.zoo._harness import train_zoo

    results = {}
    for layout in layouts:
        cell_models = [m for m in models if (layout, m) in OTHER_CELLS]
        results.update(train_zoo([layout], cell_models) or {})
    return results


@pytest.mark.parametrize("layout, name", OTHER_CELLS)
def test_attention_variant_under_pipeline_zero3_and_selective_ac_matches_single_process(layout, name):
    """The same models with no tensor parallelism: pp2 (1F1B), ZeRO-3 on 2 ranks, selective AC."""
    if not _other_runs:
        _other_runs.update(run_distributed(_train_other, 2, OTHER_LAYOUTS, MODELS, timeout=840)[0])
    result = _other_runs[layout][name]
    assert not isinstance(result, str), f"{name} under {layout} failed:\n{result}"
    losses, params, differing, *_ = result
    ref_losses, ref_params, *_ = _reference(name)
    assert not differing, f"{name} {layout}: parameters differ between ranks holding them: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), f"{name} {layout}", rtol=1e-5, loss_rtol=1e-5)
