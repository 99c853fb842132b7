"""ShardedMuon under the strategy's layouts trains like torch's Muon + AdamW in one process, each matrix
orthogonalized on one rank only.

Oracle: one process, manual optimization with ``torch.optim.Muon`` (hidden matrices) and ``torch.optim.AdamW``
(embedding, head, norms), torch's Newton-Schulz replaced by the same iteration in the training dtype. The model is
fp64 (Lightning's "64-true" is not offered by ModelParallelStrategy; the reference model still takes its norms and
loss in fp32): Newton-Schulz's quintic multiplies a direction's weight by up to 3.4 per iteration, so fp32
reduction-order noise in the gradients (1e-7) leaves five iterations near 1e-5, where a 1e-5 tolerance would decide
nothing. In fp64 the layouts land within 1.5e-8 of the oracle (tp2's worst parameter); the bound is 1e-6. Per-step
loss and every parameter after 10 steps. The Newton-Schulz calls of all ranks together number the model's hidden
matrices times the steps: one per matrix, where torch's Muon on DTensors runs it on every rank of the matrix's mesh.
"""

from __future__ import annotations

import pytest
import torch

import lightning_llm.optim.muon as muon_module
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.optim import ShardedMuon, muon_param_groups
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import STEPS, assert_parity, train

pytestmark = [
    pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs a newer torch"),
    pytest.mark.timeout(600),
]
RTOL = 1e-6
HIDDEN_MATRICES = 14  # 7 per block of the 2-block tiny reference model (q, k, v, o, gate, up, down)
MUON = dict(lr=0.02, weight_decay=0.1)
ADAMW = dict(lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95))


def _model(cls) -> CausalLM:
    torch.manual_seed(0)
    module = cls(LlamaConfig.from_name("tiny", n_layers=2))
    module.configure_model()
    return module.double()


class ShardedMuonLM(CausalLM):
    def configure_optimizers(self):
        adamw = {k: v for k, v in ADAMW.items() if k != "lr"} | {"adamw_weight_decay": ADAMW["weight_decay"]}
        adamw.pop("weight_decay")
        return ShardedMuon(muon_param_groups(self, adamw_lr=ADAMW["lr"], **adamw), **MUON, ns_dtype=torch.float64)


class TorchMuonLM(CausalLM):
    """The oracle: torch's two optimizers, stepped by hand, the split written out by parameter name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self):
        named = dict(self.named_parameters())
        hidden = [p for n, p in named.items() if p.ndim == 2 and "tok_embeddings" not in n and "output" not in n]
        others = [p for p in named.values() if all(p is not h for h in hidden)]
        assert len(hidden) == HIDDEN_MATRICES
        return [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(others, **ADAMW, foreach=False)]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()
        return loss


def _newton_schulz_in_grad_dtype(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's iteration (torch/optim/_muon.py) in the gradient's dtype instead of bf16, written out."""
    a, b, c = ns_coefficients
    x = grad
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def _count_newton_schulz():
    calls = {"n": 0}
    original = muon_module.newton_schulz

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    muon_module.newton_schulz = counting
    return calls


def _layouts(world_size: int, layouts: list[dict]):
    calls = _count_newton_schulz()
    results = []
    for layout in layouts:
        calls["n"] = 0
        tp = layout.get("tensor_parallel_size", 1)
        pp = layout.get("pipeline_parallel_size", 1)
        strategy = LLMParallelStrategy(**layout)
        dp = world_size // tp // pp
        got = train("reference", strategy, world_size, dp, clip=None, model=_model(ShardedMuonLM))
        results.append((got, calls["n"]))
    return results


@pytest.fixture(scope="module")
def one_process():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _newton_schulz_in_grad_dtype)
        # Lightning counts each of the two optimizers' steps as a training step under manual optimization.
        return train("reference", clip=None, model=_model(TorchMuonLM), steps=2 * STEPS)


TWO_RANKS = {
    "zero3": {"zero_stage": 3},
    "zero0": {"zero_stage": 0},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
}


@pytest.mark.distributed
def test_two_rank_layouts_match_torch_muon_with_one_newton_schulz_per_matrix(one_process):
    per_rank = run_distributed(_layouts, 2, 2, list(TWO_RANKS.values()), timeout=560)
    for i, label in enumerate(TWO_RANKS):
        assert_parity(per_rank[0][i][0], one_process, f"ShardedMuon {label}", rtol=RTOL)
        assert sum(rank[i][1] for rank in per_rank) == HIDDEN_MATRICES * STEPS, label
        assert all(rank[i][1] > 0 for rank in per_rank), f"{label}: one rank did all the work"


@pytest.mark.distributed
def test_tp2_by_zero3_dp2_matches_torch_muon(one_process):
    """4 ranks: FSDP2 over tensor-parallel shards (``_StridedShard`` placements) gathered and scattered back."""
    per_rank = run_distributed(_layouts, 4, 4, [{"tensor_parallel_size": 2, "zero_stage": 3}], timeout=560)
    assert_parity(per_rank[0][0][0], one_process, "ShardedMuon tp2 x dp2 ZeRO-3", rtol=RTOL)
    assert sum(rank[0][1] for rank in per_rank) == HIDDEN_MATRICES * STEPS
