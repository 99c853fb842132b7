"""MoE experts under tensor parallelism: whole experts per tp rank, exact in float64, really split, own layout kept.

The zoo (tests/zoo) trains Mixtral and Qwen3-MoE under tp2, tp2+SP and dp2 x tp2 in fp32 against one process.
Here one step runs in float64, where a correct split agrees with one process to rounding (1e-12) and a route
sent to the wrong rank's expert, or a partial gradient left unsummed (the router's), shows at full size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llm.parallel.tp.experts import check_experts
from lightning_llm.parallel.tp.plan import add_sequence_parallel_boundaries, resolve_plan
from lightning_llm.testing import run_distributed
from tests.parallel._tp_models import HF_SOURCES

# (zoo model, Hugging Face experts implementation): the eager loop and batched_mm run the routes differently; the
# reference model's experts (lightning_llm.models.moe, dense first block, a shared expert) have one implementation.
# Llama 4's experts take the tokens repeated once per expert (every expert runs on every token, scaled by its score).
CASES = [
    ("mixtral", "eager"),
    ("mixtral", "batched_mm"),
    ("qwen3_moe", "eager"),
    ("reference_moe", "loop"),
    ("llama4", "rows"),
]

# Llama 4 computes its rotary embedding (complex float32) and its router's sigmoid in float32 whatever the model's
# dtype, so one process and tp2 agree to float32 rounding there (measured: loss 7.8e-11, gradients <= 1.1e-7).
FLOAT32_INSIDE = {"llama4": (1e-9, 1e-5)}


def _experts(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(".experts")]


def test_hf_moe_plan_splits_experts_and_drops_their_weight_entries():
    from tests.zoo._models import ZooLM

    for name in ("mixtral", "qwen3_moe"):
        module = ZooLM(name)
        plan, source, *_ = resolve_plan(module, blocks_name="model.model.layers", blocks=module.model.model.layers)
        assert source in HF_SOURCES
        assert plan["model.model.layers.*.mlp.experts"] == "experts"
        assert not any(p.endswith(("gate_up_proj", "experts.down_proj")) for p in plan), plan
        # Qwen3-MoE's HF plan also names dense-MLP layers (mlp.gate_proj); this config has none, so they are dropped.
        assert "model.model.layers.*.mlp.gate_proj" not in plan
        sp = add_sequence_parallel_boundaries(module, plan, "model.model.layers")
        layers = len(module.model.model.layers)  # named one by one: in hybrid stacks "mlp" may be dense elsewhere
        assert all(sp[f"model.model.layers.{i}.mlp"] == "gather_sequence" for i in range(layers)), sp


def test_experts_that_cannot_be_split_exactly_are_refused():
    from tests.zoo._models import ZooLM

    experts = _experts(ZooLM("mixtral"))[0]  # 4 experts
    check_experts("experts", experts, 2)
    with pytest.raises(ValueError, match="has 4 experts, not divisible by tensor_parallel_size=3"):
        check_experts("experts", experts, 3)

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = 4
            self.w = nn.Parameter(torch.zeros(4, 8, 8))

        def forward(self, x, router_indices, routing_weights):
            return x

    with pytest.raises(ValueError, match=r"no argument\(s\) \['hidden_states', 'top_k_index', 'top_k_weights'\]"):
        check_experts("other", Other(), 2)

    class RoutedByKeywords(Other):  # GptOss: optional routing arguments are not the one-tensor (Llama 4) form
        def forward(self, hidden_states, router_indices=None, routing_weights=None):
            return hidden_states

    with pytest.raises(ValueError, match=r"no argument\(s\)"):
        check_experts("gpt_oss_like", RoutedByKeywords(), 2)
    with pytest.raises(ValueError, match="int `num_experts`"):
        check_experts("linear", nn.Linear(4, 4), 2)
    with_norm = _experts(ZooLM("mixtral"))[0]
    with_norm.shared_norm = nn.LayerNorm(4)  # a submodule's parameters must not be split by "experts"
    with pytest.raises(ValueError, match="none in submodules"):
        check_experts("experts", with_norm, 2)


def _build(name: str, implementation: str) -> nn.Module:
    from tests.zoo._models import ZooLM
    from tests.zoo._models_hybrid import register
    from tests.zoo._models_more import register as register_more

    register()
    register_more()
    module = ZooLM(name)
    for experts in _experts(module):  # grouped_mm, the default, has no float64 kernel on CPU
        if hasattr(experts, "config"):
            experts.config._experts_implementation = implementation
    return module


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def _fp64_ranks(cases: list[tuple[str, str]]) -> dict | None:
    """On each rank: float64 one-step gradients under tp2 and tp2+SP vs one process, expert bytes, full state."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize
    from tests.zoo._harness import tokens

    torch.set_default_dtype(torch.float64)
    dims = ParallelDims(world_size=2, tp=2)
    dims.build_mesh("cpu")
    batch = tokens()[:4]
    results = {}
    for name, implementation in cases:
        for sp in (False, True):
            reference, module = _build(name, implementation), _build(name, implementation)
            module.load_state_dict(reference.state_dict())
            ref_loss = reference.training_step(batch, 0)
            ref_loss.backward()
            parallelize(module, dims, zero_stage=0, sequence_parallel=sp)
            loss = module.training_step(batch, 0)
            loss.backward()
            errors = {}
            for (key, param), (_, ref) in zip(module.named_parameters(), reference.named_parameters()):
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                errors[key] = ((grad - ref.grad).norm() / ref.grad.norm().clamp_min(1e-30)).item()
            experts = [p for e in _experts(module) for p in e.parameters()]
            lent_back = all(isinstance(p, DTensor) for p in experts)
            local = sum(p.to_local().numel() for p in experts)
            whole = sum(p.numel() for e in _experts(reference) for p in e.parameters())
            state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
            unmodified = _build(name, implementation)
            unmodified.load_state_dict(state)  # strict: the model's own names and shapes
            with torch.no_grad():
                gap = _logits(unmodified.model(batch)) - _logits(reference.model(batch))
            results[(name, implementation, sp)] = (
                abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                errors,
                local,
                whole,
                gap.abs().max().item(),
                lent_back,
            )
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def fp64_results():
    return run_distributed(_fp64_ranks, 2, CASES, timeout=240)[0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("name, implementation", CASES)
def test_experts_are_exact_in_float64(fp64_results, name, implementation, sp):
    loss_error, errors, _, _, _, lent_back = fp64_results[(name, implementation, sp)]
    loss_tolerance, tolerance = FLOAT32_INSIDE.get(name, (1e-12, 1e-10))
    assert loss_error < loss_tolerance
    for key, error in errors.items():
        assert error < tolerance, f"{name}/{implementation} sp={sp}: gradient of {key} off by {error:.1e}"
    assert lent_back, "the experts' parameters must be DTensors again after the forward"


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, implementation", CASES)
def test_each_rank_holds_half_the_experts_and_the_state_keeps_the_models_layout(fp64_results, name, implementation):
    _, _, local, whole, gap, _ = fp64_results[(name, implementation, False)]
    assert local * 2 == whole
    assert gap < 1e-12


def _tp2_with_checkpointing(models: list[str]) -> dict:
    from tests.zoo import _harness

    _harness.LAYOUTS["tp2_ac_full"] = (2, {"tensor_parallel_size": 2, "activation_checkpointing": "full"})
    _harness.LAYOUTS["tp2_ac_selective"] = (2, {"tensor_parallel_size": 2, "activation_checkpointing": "selective"})
    return _harness.train_zoo(["tp2_ac_full", "tp2_ac_selective"], models)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_experts_under_tp_with_activation_checkpointing_train_like_one_process():
    """The recompute runs the experts' forward again: the lent local weights and the remapped routes must match."""
    from tests.strategies._parity import assert_parity
    from tests.zoo._harness import train

    runs = run_distributed(_tp2_with_checkpointing, 2, ["mixtral"], timeout=240)[0]
    reference = train("mixtral")
    for layout, result in runs.items():
        result = result["mixtral"]
        assert not isinstance(result, str), result
        losses, params, differing, *_ = result
        assert not differing, f"{layout}: parameters differ between tp ranks: {differing}"
        assert_parity((losses, params), reference[:2], f"mixtral {layout}", rtol=1e-5, loss_rtol=1e-5)
