"""Expert parallelism's dispatch on one experts module: exact against the whole module, tokens moved by all-to-all.

Two gloo ranks hold different tokens and half the experts each; outputs and every gradient (tokens, router scores,
expert weights) must equal what one process computes with all experts, in float64. The communication check counts
the collectives of the EP forward with torch's ``CommDebugMode``: all-to-alls only, none carrying every expert's
output (:class:`tests.parallel._collectives.Collectives` records each collective op with the elements it sends).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_llm.parallel.ep.apply import (
    apply_expert_parallel,
    check_expert_parallel_model,
    check_experts,
    find_experts,
)
from lightning_llm.parallel.ep.mesh import ExpertMeshes, check_expert_parallel_size
from lightning_llm.testing import run_distributed
from tests.parallel._collectives import Collectives

transformers = pytest.importorskip("transformers")

TOKENS, DIM, EXPERTS, TOP_K = 12, 8, 8, 2


def _experts(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            hidden_size=DIM, intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
        )
        module = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    else:
        config = transformers.GptOssConfig(
            hidden_size=DIM, intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
        )
        module = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return module.double()


def _inputs(rank: int, skewed: bool):
    g = torch.Generator().manual_seed(10 + rank)
    hidden = torch.randn(TOKENS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    # skewed: every route goes to rank 0's experts, so rank 1 receives no token at all
    high = EXPERTS // 2 if skewed else EXPERTS
    index = torch.stack([torch.randperm(high, generator=g)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64, requires_grad=True)
    return hidden, index, weights


class _Holder(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def _ep_vs_whole(kind: str, skewed: bool):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
    meshes = ExpertMeshes(ep=mesh["ep"], edp=mesh["edp"], dp=2)
    whole, holder = _experts(kind), _Holder(_experts(kind))
    apply_expert_parallel(holder, check_expert_parallel_model(holder, 2), meshes=meshes)
    hidden, index, weights = _inputs(rank, skewed)
    with Collectives() as comm:
        out = holder(hidden, index, weights)
    out.square().sum().backward()
    # The reference: one process, all experts, this rank's tokens.
    ref_hidden, ref_weights = hidden.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    ref = whole(ref_hidden, index, ref_weights)
    ref.square().sum().backward()
    # Expert gradients: this rank's shard holds the sum over both ranks' tokens, scaled by 1 / ep (the data-parallel
    # mean over the ranks outside the EP group, none here, completes the mean over all data-parallel ranks).
    grads = {}
    for name, p in holder.experts.named_parameters():
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        ref_grad = getattr(whole, name).grad.clone()
        dist.all_reduce(ref_grad)
        grads[name] = (local, ref_grad.chunk(2)[rank] / 2)
    return dict(
        out=(out.detach(), ref.detach()),
        hidden=(hidden.grad, ref_hidden.grad),
        weights=(weights.grad, ref_weights.grad),
        grads=grads,
        calls=comm.calls,
        local_experts=holder.experts.num_experts,
    )


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ep_forward_and_gradients_are_exact_and_move_tokens_by_all_to_all():
    cases = [(kind, skewed) for kind in ("mixtral", "gpt_oss") for skewed in (False, True)]
    results = run_distributed(_run_cases, 2, cases, timeout=110)
    for rank_results in results:
        for (kind, skewed), got in zip(cases, rank_results):
            label = f"{kind} skewed={skewed}"
            assert got["local_experts"] == EXPERTS // 2, label
            for key in ("out", "hidden", "weights"):
                torch.testing.assert_close(*got[key], rtol=1e-12, atol=1e-12, msg=lambda m: f"{label} {key}: {m}")
            for name, (local, ref) in got["grads"].items():
                torch.testing.assert_close(local, ref, rtol=1e-12, atol=1e-12, msg=lambda m: f"{label} {name}: {m}")
            # The counts, then the routed rows, then the outputs home: three all-to-alls and nothing else; the
            # rows sent are this rank's routes (tokens x top_k x dim), never every expert's output for every token.
            names = [name for name, _ in got["calls"]]
            assert names == ["c10d.alltoall_base_", *["_c10d_functional.all_to_all_single"] * 2], f"{label}: {names}"
            assert got["calls"][0][1] == EXPERTS and got["calls"][1][1] == TOKENS * TOP_K * DIM, label
            assert max(n for _, n in got["calls"]) < EXPERTS * TOKENS * DIM, label


def _run_cases(cases):
    dist.init_process_group("gloo")
    return [_ep_vs_whole(kind, skewed) for kind, skewed in cases]


@pytest.mark.timeout(30)
def test_refusals_name_the_module_and_numbers():
    experts = _experts("mixtral")
    with pytest.raises(ValueError, match=r"8 experts, not divisible by expert_parallel_size=3"):
        check_experts("model.layers.0.mlp.experts", experts, ep=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide the data-parallel size 2"):
        check_expert_parallel_size(4, 2)
    router = torch.nn.Linear(DIM, EXPERTS)
    router.num_experts = EXPERTS
    with pytest.raises(ValueError, match=r"'router' cannot be split by expert"):
        check_experts("router", router, ep=2)

    class OneArg(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = 2
            self.w = torch.nn.Parameter(torch.zeros(2, 3, 3))

        def forward(self, x):
            return x

    with pytest.raises(ValueError, match=r"first three arguments"):
        check_experts("mine", OneArg(), ep=2)
    holder = _Holder(_experts("mixtral"))
    assert [n for n, _ in find_experts(holder)] == ["experts"]
    assert find_experts(holder, {"experts": "data_parallel"}) == []
