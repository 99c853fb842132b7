"""Expert parallelism against one process: three Hugging Face MoE architectures, ep2 under ZeRO 0, 1 and 3.

Each model (Mixtral; Qwen3-MoE; DeepSeek-V3 with a dense first block, shared experts and multi-head latent
attention) trains for the zoo's steps in fp32 on 2 gloo ranks with ``expert_parallel_size=2`` and must match the
same model trained by one process: per-step loss and every parameter within 1e-5 relative, parameters identical on
every rank holding them, each rank holding half the expert parameters (whole experts: 2 of 4 per layer), and the
trained routers sending every token to the same experts as the single process's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_llm.parallel.ep.apply import find_experts
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity
from tests.zoo._harness import tokens, train
from tests.zoo._models import ZooLM
from tests.zoo._models_hybrid import register

pytestmark = [pytest.mark.distributed]

pytest.importorskip("transformers")

MODELS = ["mixtral", "qwen3_moe", "deepseek_v3"]
LAYOUTS = {
    "ep2_zero0": {"expert_parallel_size": 2, "zero_stage": 0},
    "ep2_zero1": {"expert_parallel_size": 2, "zero_stage": 1},
    "ep2_zero3": {"expert_parallel_size": 2, "zero_stage": 3},
}
_references: dict = {}


def _train_all(layouts: list[str], models: list[str]) -> dict | None:
    register()
    results = {}
    for layout in layouts:
        results[layout] = {
            name: train(name, LLMParallelStrategy(**LAYOUTS[layout]), devices=2, dp=2) for name in models
        }
    return results if dist.get_rank() == 0 else None


def _reference(name: str):
    register()
    if name not in _references:
        _references[name] = train(name)
    return _references[name]


def _routes(name: str, params: dict) -> list[torch.Tensor]:
    """The experts every token of the training data is sent to, per MoE layer, by a model holding ``params``:
    read at each experts module's input (the router's top-k), so it works for any architecture."""
    register()
    module = ZooLM(name)
    module.load_state_dict(params)
    routes = []
    for _, experts in find_experts(module):
        experts.register_forward_pre_hook(lambda m, args: routes.append(args[1].sort(-1).values))
    with torch.no_grad():
        module.model(tokens())
    return routes


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_train_all, 2, list(LAYOUTS), MODELS, timeout=840)[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", MODELS)
def test_expert_parallel_matches_single_process(runs, layout, name):
    losses, params, differing, _, held = runs[layout][name]
    ref_losses, ref_params, *_ = _reference(name)
    label = f"{name} {layout}"
    assert not differing, f"{label}: parameters differ between ranks holding them: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), label, rtol=1e-5, loss_rtol=1e-5)
    # Whole experts split over 2 ranks: the most any rank holds is half (the shares of 2 ranks sum to 1).
    assert held["experts"] == pytest.approx(0.5, rel=0.05), f"{label}: a rank holds {held}"
    got, want = _routes(name, params), _routes(name, ref_params)
    assert len(got) == len(want) > 0
    for layer, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{label}: routing of MoE layer {layer} differs from the single process"
    print(f"{label}: max loss rel diff {max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)):.1e}")
