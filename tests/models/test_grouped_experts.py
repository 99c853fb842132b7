"""The reference model's grouped-GEMM experts against its loop, and against one process under expert parallelism.

``torch._grouped_mm`` runs on CPU in fp32, so the grouped path (routes sorted by expert, groups padded to 16 rows,
two grouped matmuls) is compared on CPU with the per-expert loop it replaces: output and every gradient within
1e-5 relative, over routes that leave an expert idle and one id past the local experts (selects nothing). A tiny MoE
model trained with it under ep2 matches the same model trained with the loop by one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.models.grouped_experts import grouped_swiglu
from lightning_llm.models.moe import Experts
from lightning_llm.testing import run_distributed
from tests.strategies import _parity

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason=f"torch {torch.__version__} has no torch._grouped_mm"
)


def _experts(implementation: str) -> Experts:
    torch.manual_seed(0)
    experts = Experts(num_experts=4, dim=16, hidden_dim=24, implementation=implementation)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    return experts


def _inputs():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(13, 16, generator=generator)
    ids = torch.randint(0, 3, (13, 2), generator=generator)  # expert 3 gets no route
    ids[4, 1] = 6  # past the local experts (4): selects nothing
    weights = torch.rand(13, 2, generator=generator)
    return hidden, ids, weights


def _run(experts: Experts, hidden, ids, weights, grad, **kwargs):
    hidden, weights = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    if kwargs:
        out = grouped_swiglu(hidden, experts.gate_up_proj, experts.down_proj, ids, weights, **kwargs)
    else:
        out = experts(hidden, ids, weights)
    grads = torch.autograd.grad(out, [hidden, weights, experts.gate_up_proj, experts.down_proj], grad)
    return [out, *grads]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("align", [1, 16])
def test_grouped_experts_compute_what_the_loop_computes(align):
    hidden, ids, weights = _inputs()
    grad = torch.randn(13, 16, generator=torch.Generator().manual_seed(2))
    loop = _run(_experts("loop"), hidden, ids, weights, grad)
    grouped = _run(_experts("grouped_mm"), hidden, ids, weights, grad, align=align)
    for name, got, want in zip(["output", "d hidden", "d weights", "d gate_up", "d down"], grouped, loop):
        assert _relative(got, want) <= 1e-5, f"{name}: {_relative(got, want):.2e}"
    assert grouped[2][4, 1] == 0  # the id past the local experts got nothing, as in the loop
    assert loop[0][4].ne(0).any()


def test_the_module_uses_the_grouped_path_only_where_asked():
    hidden, ids, weights = _inputs()
    calls = []
    original = torch._grouped_mm
    try:
        torch._grouped_mm = lambda *a, **k: calls.append(1) or original(*a, **k)
        _experts("auto")(hidden, ids, weights)  # CPU: the loop
        assert calls == []
        _experts("grouped_mm")(hidden, ids, weights)
        assert len(calls) == 2
    finally:
        torch._grouped_mm = original
    with pytest.raises(ValueError, match="moe_implementation='grouped_mm' does not run on torch.float64 cpu"):
        _experts("grouped_mm").double()(hidden.double(), ids, weights.double())
    with pytest.raises(ValueError, match="moe_implementation"):
        LlamaConfig.from_name("tiny-moe", moe_implementation="fast")


def _moe(implementation: str) -> CausalLM:
    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny-moe", vocab_size=256, n_layers=2, moe_implementation=implementation)
    module = CausalLM(config, warmup_steps=2, max_steps=_parity.STEPS)
    module.configure_model()
    return module


def _train_ep2() -> dict | None:
    from lightning_llm.strategies import LLMParallelStrategy

    result = _parity.train(
        "reference", LLMParallelStrategy(expert_parallel_size=2), devices=2, dp=2, model=_moe("grouped_mm")
    )
    return result if dist.get_rank() == 0 else None


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_grouped_experts_under_expert_parallelism_match_the_loop_in_one_process():
    got = run_distributed(_train_ep2, 2, timeout=240)[0]
    want = _parity.train("reference", model=_moe("loop"))
    _parity.assert_parity(got, want, rtol=1e-5, label="ep2 grouped_mm vs one process loop")
