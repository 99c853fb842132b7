"""The reference model's mixture of experts against hand computations and torch's FLOP counter."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_llm.modeling.experts import inactive_expert_parameters
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.models import CausalLM, Llama, LlamaConfig
from lightning_llm.models.moe import Experts, MoEFeedForward


def _swiglu(x, gate_up, down):
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def test_experts_sum_each_tokens_routes_weighted_as_a_loop_over_tokens_would():
    torch.manual_seed(0)
    experts = Experts(num_experts=4, dim=8, hidden_dim=6)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x, ids, weights = torch.randn(5, 8), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    expected = torch.stack(
        [
            sum(weights[t, j] * _swiglu(x[t], experts.gate_up_proj[ids[t, j]], experts.down_proj[ids[t, j]]) for j in range(2))
            for t in range(5)
        ]
    )  # fmt: skip
    torch.testing.assert_close(experts(x, ids, weights), expected)
    # An id past the module's experts (tensor parallelism's off-rank sentinel) contributes nothing.
    sentinel = ids.clone()
    sentinel[:, 1] = 4
    only_first = torch.stack(
        [weights[t, 0] * _swiglu(x[t], experts.gate_up_proj[ids[t, 0]], experts.down_proj[ids[t, 0]]) for t in range(5)]
    )
    torch.testing.assert_close(experts(x, sentinel, weights), only_first)


def test_router_takes_the_softmax_top_k_renormalized_and_the_aux_loss_is_switch_transformers():
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=8, hidden_dim=6, num_experts=4, top_k=2, aux_loss_coef=0.5)
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 3, 8)
    _, ids, weights = moe.router(x.flatten(0, 1))
    softmax = (x.flatten(0, 1) @ moe.router.weight.T).softmax(-1)
    assert torch.equal(ids.sort(-1).values, softmax.topk(2).indices.sort(-1).values)
    torch.testing.assert_close(weights, softmax.gather(-1, ids) / softmax.gather(-1, ids).sum(-1, keepdim=True))
    moe(x)
    fraction = torch.tensor([(ids == e).sum().item() / ids.numel() for e in range(4)])
    torch.testing.assert_close(moe.aux_loss, 0.5 * 4 * (fraction * softmax.mean(0)).sum())
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0  # the balancing loss trains the router


def test_causal_lm_adds_the_aux_loss_of_every_moe_block_to_its_training_loss():
    config = LlamaConfig.from_name("tiny-moe", n_layers=3, moe_aux_loss_coef=0.1)
    module = CausalLM(config)
    module.configure_model()
    batch = torch.randint(0, 256, (2, 17))
    loss = module.training_step(batch, 0)
    aux = [m.aux_loss for m in module.model.modules() if isinstance(m, MoEFeedForward)]
    assert len(aux) == 3 and all(a > 0 for a in aux)
    torch.testing.assert_close(loss, module._loss(batch) + sum(aux))


@pytest.mark.parametrize("preset", ["tiny-moe", "small-moe"])
def test_flops_per_token_count_active_experts_as_torchs_flop_counter_does(preset):
    model = Llama(LlamaConfig.from_name(preset))
    tokens = torch.randint(0, 256, (2, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens)
    counted = 3 * counter.get_total_flops() / tokens.numel()
    # Norm weights are parameters without matmuls: the accounting's only difference, under 0.5%.
    assert ModelShape.of(model).flops_per_token(64) == pytest.approx(counted, rel=5e-3)


def test_deepseek_v3_sized_preset_builds_on_meta_with_its_active_parameters():
    config = LlamaConfig.from_name("671B-moe")
    with torch.device("meta"):
        model = Llama(config)
    d, e, k, h = config.dim, config.n_experts, config.top_k, config.moe_hidden_dim
    expert = 3 * d * h
    attention = 2 * d * d + 2 * d * config.n_kv_heads * config.head_dim
    moe_blocks, dense_blocks = config.n_layers - config.n_dense_layers, config.n_dense_layers
    by_hand = (
        2 * config.vocab_size * d
        + config.n_layers * (attention + 2 * d)
        + dense_blocks * 3 * d * config.ffn_hidden_dim
        + moe_blocks * ((e + 1) * expert + e * d)
        + d
    )
    assert sum(p.numel() for p in model.parameters()) == by_hand
    assert inactive_expert_parameters(model) == moe_blocks * (e - k) * expert


def test_bias_balancing_chooses_on_biased_scores_and_weights_with_the_unbiased_ones():
    """DeepSeek-V3's auxiliary-loss-free routing by hand: top-k of (probabilities + bias), weights from the
    probabilities alone, renormalized; training forwards count each expert's routes."""
    from lightning_llm.models.moe import Router

    torch.manual_seed(0)
    router = Router(dim=8, num_experts=4, top_k=2, bias_update_rate=0.01)
    torch.nn.init.normal_(router.weight)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # expert 3 wins every token's first place
    x = torch.randn(6, 8)
    probs, ids, weights = router(x)
    want_probs = (x @ router.weight.T).softmax(-1)
    torch.testing.assert_close(probs, want_probs)
    assert (ids[:, 0] == 3).all()
    assert torch.equal(ids[:, 1], want_probs[:, :3].argmax(-1))  # then the best of the others, unbiased
    chosen = want_probs.gather(-1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    assert router.tokens_per_expert.tolist() == [float((ids == e).sum()) for e in range(4)]
    router.eval()
    router(x)
    assert router.tokens_per_expert.sum() == 12, "evaluation forwards are not counted"


def test_the_bias_moves_by_the_rate_toward_the_mean_load_of_each_optimizer_step():
    """Two optimizer steps of 2 accumulated micro-batches: after each, every MoE layer's bias equals the sum over
    steps of rate * sign(mean - count), the counts taken from the routers' outputs by a hook (brute force)."""
    import lightning as L

    from lightning_llm.models.moe import Router
    from lightning_llm.testing import cpu_trainer

    config = LlamaConfig.from_name("tiny-moe", vocab_size=64, n_layers=3, n_dense_layers=1, moe_bias_update_rate=0.1)
    torch.manual_seed(0)
    module = CausalLM(config, warmup_steps=1)
    module.configure_model()
    routers = [m for m in module.model.modules() if isinstance(m, Router)]
    routes = {id(r): [] for r in routers}
    for r in routers:
        r.register_forward_hook(lambda m, args, out: routes[id(m)].append(out[1].flatten().tolist()))
    biases = []

    class Biases(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % 2 == 0:
                biases.append([r.expert_bias.clone() for r in routers])

    tokens = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1))
    cpu_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[Biases()]).fit(
        module, torch.utils.data.DataLoader(tokens, batch_size=2)
    )
    want, moved = [torch.zeros(4) for _ in routers], False
    for step in range(2):
        for i, r in enumerate(routers):
            ids = [e for micro in routes[id(r)][2 * step : 2 * step + 2] for e in micro]
            counts = torch.tensor([float(ids.count(e)) for e in range(4)])
            want[i] = want[i] + 0.1 * torch.sign(counts.mean() - counts)
            torch.testing.assert_close(biases[step][i], want[i])
            moved |= bool(want[i].abs().sum() > 0)
    assert moved, "the routes were unbalanced enough to move the biases"


def test_flops_per_token_count_active_experts_of_a_module_list_moe():
    """litgpt's LLaMAMoE keeps one module per expert in a ModuleList: the accounting still counts top_k of n_expert
    (2 of 4) of them per token, as torch's FLOP counter measures on the model's own loop."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=64, vocab_size=256, padded_vocab_size=256, n_layer=2, n_head=4, n_embd=64, n_query_groups=2,
        intermediate_size=128, moe_intermediate_size=128, bias=False, rotary_percentage=1.0,
        parallel_residual=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMoE", n_expert=4,
        n_expert_per_token=2,
    )  # fmt: skip
    model = GPT(config)
    experts = sum(p.numel() for block in model.transformer.h for p in block.mlp.experts.parameters())
    assert inactive_expert_parameters(model) == experts // 2
    tokens = torch.randint(0, 256, (2, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens)
    counted = 3 * counter.get_total_flops() / tokens.numel()
    assert ModelShape.of(model).flops_per_token(64) == pytest.approx(counted, rel=5e-3), (
        ModelShape.of(model).flops_per_token(64),
        counted,
    )


def test_a_moe_model_on_the_meta_device_is_planned_with_the_flops_of_a_real_forward():
    """On fake tensors the routes have no values; each expert takes an even share (any routing runs the same matmul
    FLOPs: every token through top_k experts), so planning a meta model's memory and time does not stop there."""
    from lightning_llm.modeling.op_work import forward_work
    from lightning_llm.strategies.zero_auto import model_footprint

    config = LlamaConfig.from_name("tiny", n_layers=2, n_experts=4, top_k=2)
    torch.manual_seed(0)
    real = CausalLM(config)
    real.configure_model()
    real.log = lambda *args, **kwargs: None
    batch = torch.randint(0, 256, (2, 33))
    with FlopCounterMode(display=False) as counter:
        real.training_step(batch, 0)
    with torch.device("meta"):
        planned = CausalLM(config)
        planned.configure_model()
    planned.log = lambda *args, **kwargs: None
    work = forward_work(planned, lambda: planned.training_step(batch, 0), device=torch.device("cpu"))
    assert work.total.matmul_flops == counter.get_total_flops()
    assert model_footprint(planned, micro_batch_size=2, seq_len=32).activations > 0


def test_compiled_experts_follow_the_real_routes():
    """torch.compile traces on fake tensors: the even share the planner uses must not reach a compiled step."""
    torch.manual_seed(0)
    experts = Experts(num_experts=4, dim=16, hidden_dim=32, implementation="loop")
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x, weights = torch.randn(10, 16), torch.rand(10, 2)
    routes = torch.stack([torch.zeros(10, dtype=torch.long), torch.ones(10, dtype=torch.long)], dim=1)  # skewed
    torch.testing.assert_close(
        torch.compile(experts, backend="aot_eager")(x, routes, weights), experts(x, routes, weights)
    )
