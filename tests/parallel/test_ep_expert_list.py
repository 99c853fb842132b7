"""Expert parallelism over a ``ModuleList`` of experts called one at a time by the model's own loop.

Two gloo ranks hold different tokens and two of four experts each. A loop over every expert (litgpt's way) gives
each rank the outputs and gradients (tokens, router scores, expert weights) one process computes with all experts on
that rank's tokens, in float64; each kept expert's gradient is the sum over both ranks' tokens, scaled by 1/2 (the
data-parallel mean completes it). A loop over only the experts some token was routed to calls different experts on
the two ranks: both raise, naming the list, instead of hanging. (The whole-model parity, litgpt's ``LLaMAMoE`` under
ep2 / ep4 / ep2 x dp2 / ep2 x tp2 + SP / ep2 x pp2, is in ``tests/strategies/test_expert_parallel_parity.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_llm.parallel.ep.apply import apply_expert_parallel, check_expert_parallel_model
from lightning_llm.parallel.ep.expert_list import RemoteExpert
from lightning_llm.parallel.ep.mesh import ExpertMeshes
from lightning_llm.testing import run_distributed

TOKENS, DIM, EXPERTS, TOP_K = 10, 6, 4, 2


class _MoE(nn.Module):
    """A top-2 router and a ModuleList of MLP experts, looped over as litgpt's LLaMAMoE does."""

    def __init__(self, every_expert: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.every_expert = every_expert
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 12), nn.SiLU(), nn.Linear(12, DIM)) for _ in range(EXPERTS)
        )
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, ids = self.gate(x).softmax(-1).topk(TOP_K, dim=-1)
        y = torch.zeros_like(x)
        hit = set(ids.flatten().tolist())
        for index, expert in enumerate(self.experts):
            if not self.every_expert and index not in hit:
                continue
            token, slot = torch.where(ids == index)
            y = y.index_add(0, token, probs[token, slot, None] * expert(x[token]))
        return y


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


def _split(module: nn.Module) -> None:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    meshes = ExpertMeshes(ep=mesh["ep"], edp=mesh["edp"], dp=2)
    apply_expert_parallel(module, check_expert_parallel_model(module, 2), meshes=meshes)


def _both() -> dict:
    dist.init_process_group("gloo")
    return {"exact": _exact(), "hit only": _hit_only()}


_results: list = []


def _run() -> list[dict]:
    """Each rank's results; the first call runs both cases in one 2-rank spawn."""
    if not _results:
        _results.extend(run_distributed(_both, 2, timeout=100))
    return _results


def _exact() -> dict:
    rank = dist.get_rank()
    whole, split = _MoE(), _MoE()
    _split(split)
    x, ref_x = _tokens(rank).requires_grad_(), _tokens(rank).requires_grad_()
    out, ref = split(x), whole(ref_x)
    out.square().sum().backward()
    ref.square().sum().backward()
    kept = {i for i, e in enumerate(split.experts) if not isinstance(e, RemoteExpert)}
    grads = {i: [p.grad.clone() for p in split.experts[i].parameters()] for i in kept}
    # One process's expert gradient over both ranks' tokens: the sum of each rank's whole-model gradient.
    whole_grads = [[p.grad.clone() for p in e.parameters()] for e in whole.experts]
    for expert in whole_grads:
        for g in expert:
            dist.all_reduce(g)
    return {
        "rank": rank,
        "kept": sorted(kept),
        "out": (out - ref).abs().max().item(),
        "x": (x.grad - ref_x.grad).abs().max().item(),
        "gate": (split.gate.weight.grad - whole.gate.weight.grad).abs().max().item(),
        "experts": max((g - w / 2).abs().max().item() for i in kept for g, w in zip(grads[i], whole_grads[i])),
    }


def _hit_only() -> str:
    module = _MoE(every_expert=False)
    _split(module)
    # One token on rank 0 hits two experts; 40 tokens on rank 1 hit all four (checked below).
    x = torch.cat([_tokens(s) for s in range(4)])[: 1 if dist.get_rank() == 0 else 40]
    assert len(set(module.gate(x).topk(TOP_K, dim=-1).indices.flatten().tolist())) == (2 if dist.get_rank() == 0 else 4)
    try:
        module(x)
    except RuntimeError as error:
        return str(error)
    return "not refused"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_loop_over_every_expert_is_exact_under_expert_parallelism():
    results = [r["exact"] for r in _run()]
    assert [r["kept"] for r in results] == [[0, 1], [2, 3]]
    for r in results:
        assert max(r["out"], r["x"], r["gate"], r["experts"]) <= 1e-12, r


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ranks_calling_different_experts_are_refused_on_every_rank_not_hung():
    errors = [r["hit only"] for r in _run()]
    for error in errors:
        assert "'experts': the EP ranks called different experts" in error, error
        assert "Every rank must call every expert once per forward" in error


def test_an_expert_count_that_expert_parallelism_cannot_divide_is_refused():
    with pytest.raises(ValueError, match=r"'experts' holds 4 experts, not divisible by expert_parallel_size=3"):
        check_expert_parallel_model(_MoE(), 3)
