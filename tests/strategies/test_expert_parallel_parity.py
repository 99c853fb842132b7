"""Expert parallelism against one process: three Hugging Face MoE architectures, litgpt's and the reference MoE.

Each model (Mixtral; Qwen3-MoE; DeepSeek-V3 with a dense first block, shared experts and multi-head latent
attention; this package's Llama with MoE blocks; litgpt's LLaMAMoE, one module per expert in a ModuleList) trains for the zoo's steps in fp32 on gloo ranks and must match the same model trained by one process:
per-step loss and every parameter within 1e-5 relative, parameters identical on every rank holding them, each rank
holding its share of the expert parameters (1 / ep whole experts, further sharded over the data-parallel ranks
outside the EP group under ZeRO 1-3), and the trained routers sending every token to the same experts as the single
process's. 2 ranks: ep2 under ZeRO 0, 1 and 3, with full activation checkpointing (the recompute replays the
all-to-alls) and with gradient clipping (the global norm over every shard). 4 ranks: ep2 x dp2 (experts replicated, or
sharded by FSDP2, over the other EP group), ep4 (one expert per rank), ep2 x tp2 with sequence parallelism (attention
split over tp, experts whole per EP rank) and ep2 x pp2 (each stage's experts split over its own EP group).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.parallel.ep.apply import find_experts
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from tests.parallel._collectives import Collectives
from tests.strategies import _parity
from tests.strategies._parity import assert_parity
from tests.zoo._harness import GLOBAL_BATCH, SEQ_LEN, tokens, train
from tests.zoo._models import ZooLM
from tests.zoo._models_hybrid import register

pytestmark = [pytest.mark.distributed]

pytest.importorskip("transformers")

MODELS = ["mixtral", "qwen3_moe", "deepseek_v3", "reference_moe", "litgpt_moe"]
LIST_MODELS = ["litgpt_moe"]  # experts in a ModuleList (parallel/ep/expert_list.py)
# layout -> (world size, strategy arguments, the share of expert parameters each rank holds)
LAYOUTS = {
    "ep2_zero0": (2, {"expert_parallel_size": 2, "zero_stage": 0}, 1 / 2),
    "ep2_zero1": (2, {"expert_parallel_size": 2, "zero_stage": 1}, 1 / 2),
    "ep2_zero3": (2, {"expert_parallel_size": 2, "zero_stage": 3}, 1 / 2),
    "ep2_zero3_ac_full": (2, {"expert_parallel_size": 2, "zero_stage": 3, "activation_checkpointing": "full"}, 1 / 2),
    "ep2_zero3_clip": (2, {"expert_parallel_size": 2, "zero_stage": 3}, 1 / 2),
    "ep2xdp2_zero0": (4, {"expert_parallel_size": 2, "zero_stage": 0}, 1 / 2),
    "ep2xdp2_zero3": (4, {"expert_parallel_size": 2, "zero_stage": 3}, 1 / 4),
    "ep4_zero3": (4, {"expert_parallel_size": 4, "zero_stage": 3}, 1 / 4),
    # Attention tensor parallel (+ SP), experts whole per EP rank (the same on both tp ranks, which hold the same
    # tokens); and pipeline stages each with their layers' experts split over their own EP group.
    "ep2xtp2_sp_zero3": (4, {"expert_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}, 1 / 2),
    "ep2xpp2_zero3": (4, {"expert_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 3}, 1 / 2),
}
# The models a layout trains, where not all of them (the cheapest set that still covers each expert layout).
LAYOUT_MODELS = {
    "ep2xtp2_sp_zero3": ["mixtral", "deepseek_v3", "reference_moe", "litgpt_moe"],
    "ep2xpp2_zero3": [
        "qwen3_moe",
        "deepseek_v3",
        "reference_moe",
        "litgpt_moe",
    ],  # DeepSeek: a first stage with no experts
}
CELLS = [(layout, name) for layout in LAYOUTS for name in LAYOUT_MODELS.get(layout, MODELS)]
# Refused at setup, before any step: (label, model, strategy arguments, what the message must say)
REFUSED = [
    ("dense model", "llama", {"expert_parallel_size": 2}, "the model has no experts module to split"),
    ("ep above dp", "mixtral", {"expert_parallel_size": 4}, "expert_parallel_size=4 does not divide the data-parallel"),
    (
        "plan names a router",
        "mixtral",
        {"expert_parallel_size": 2, "expert_parallel_plan": {"*.mlp.gate": "expert_parallel"}},
        "'model.model.layers.0.mlp.gate' cannot be split by expert",
    ),
]
# Auxiliary-loss-free balancing (the reference model's per-expert router bias, moved after every optimizer step from
# counts all-reduced over every rank): layout -> (strategy arguments, data-parallel size).
BIAS_LAYOUTS = {
    "ep2_zero3": ({"expert_parallel_size": 2, "zero_stage": 3}, 2),
    "tp2": ({"tensor_parallel_size": 2}, 1),
    "pp2": ({"pipeline_parallel_size": 2}, 1),
}
# Trainer arguments of a layout (and of its single-process reference): clipping at 0.05 changes the losses by ~1e-4,
# so a global norm that missed or double-counted the experts' shards would break the 1e-5 parity.
TRAINER = {"ep2_zero3_clip": {"gradient_clip_val": 0.05}}
_references: dict = {}


def _train_all(layouts: list[str], models: list[str]) -> dict | None:
    register()
    results = {}
    for layout in layouts:
        world_size, kwargs, _ = LAYOUTS[layout]
        trainer = TRAINER.get(layout, {})
        dp = world_size // kwargs.get("tensor_parallel_size", 1) // kwargs.get("pipeline_parallel_size", 1)
        results[layout] = {
            name: train(name, LLMParallelStrategy(**kwargs), devices=world_size, dp=dp, **trainer)
            for name in LAYOUT_MODELS.get(layout, models)
        }
    if world_size == 2:  # the collectives of one training forward, and what setup refuses, in the same group
        results["bias balancing"] = {
            layout: _parity.train("reference", LLMParallelStrategy(**kwargs), devices=2, dp=dp, model=_bias_balanced())
            for layout, (kwargs, dp) in BIAS_LAYOUTS.items()
        }
        results["collectives"] = _forward_collectives("mixtral")
        results["refusals"] = {
            label: _error(lambda: train(name, LLMParallelStrategy(**kwargs), devices=2, dp=2))
            for label, name, kwargs, _ in REFUSED
        }
    return results if dist.get_rank() == 0 else None


class _ForwardCollectives(L.Callback):
    """Records the collectives of the first training step's forward (batch start to backward)."""

    def __init__(self) -> None:
        self.mode = Collectives()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.mode.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == 0:
            self.mode.__exit__(None, None, None)


def _bias_balanced():
    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny-moe", vocab_size=256, n_layers=2, moe_bias_update_rate=0.01)
    module = CausalLM(config, warmup_steps=2, max_steps=_parity.STEPS)
    module.configure_model()
    return module


def _forward_collectives(name: str) -> list[tuple[str, int]]:
    recorder = _ForwardCollectives()
    trainer = cpu_trainer(
        devices=2,
        strategy=LLMParallelStrategy(expert_parallel_size=2, zero_stage=0),
        max_steps=1,
        callbacks=[recorder],
    )
    trainer.fit(ZooLM(name), DataLoader(tokens(), batch_size=GLOBAL_BATCH // 2))
    return recorder.mode.calls


def _error(fn) -> str:
    try:
        fn()
    except Exception as error:
        return str(error)
    return "not refused"


def _reference(name: str, layout: str):
    register()
    trainer = TRAINER.get(layout, {})
    key = (name, tuple(trainer.items()))
    if key not in _references:
        _references[key] = train(name, **trainer)
    return _references[key]


def _routes(name: str, params: dict) -> list[torch.Tensor]:
    """The experts every token of the training data is sent to, per MoE layer, by a model holding ``params``:
    read at each experts module's input (the router's top-k), so it works for any architecture."""
    register()
    module = ZooLM(name)
    module.load_state_dict(params)
    routes = []
    for _, experts in find_experts(module):
        if isinstance(experts, torch.nn.ModuleList):  # called one expert at a time: no routing call to read
            continue
        experts.register_forward_pre_hook(lambda m, args: routes.append(args[1].sort(-1).values))
    with torch.no_grad():
        module.model(tokens())
    return routes


_runs: dict = {}


def _run(layout: str) -> dict:
    """The layout's results; the first call trains every layout of its world size in one spawn."""
    if layout not in _runs:
        world_size = LAYOUTS[layout][0]
        group = [name for name, (size, *_) in LAYOUTS.items() if size == world_size]
        try:
            _runs.update(run_distributed(_train_all, world_size, group, MODELS, timeout=840)[0])
        except Exception as error:  # one failed spawn fails its layouts once, not once per cell
            _runs.update({name: error for name in [*group, "refusals", "collectives"]})
    if isinstance(_runs[layout], Exception):
        raise _runs[layout]
    return _runs[layout]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("layout", "name"), CELLS, ids=[f"{name}-{layout}" for layout, name in CELLS])
def test_expert_parallel_matches_single_process(layout, name):
    losses, params, differing, _, held = _run(layout)[name]
    ref_losses, ref_params, *_ = _reference(name, layout)
    label = f"{name} {layout}"
    assert not differing, f"{label}: parameters differ between ranks holding them: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), label, rtol=1e-5, loss_rtol=1e-5)
    # The most any rank holds; the shares of the ranks of one replica sum to 1, so every rank holds this much.
    assert held["experts"] == pytest.approx(LAYOUTS[layout][2], rel=0.05), f"{label}: a rank holds {held}"
    got, want = _routes(name, params), _routes(name, ref_params)
    assert len(got) == len(want) > 0 or name in LIST_MODELS
    for layer, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{label}: routing of MoE layer {layer} differs from the single process"
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_diff = max(((params[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref_params.items())
    print(f"{label}: max relative loss diff {loss_diff:.1e}, parameter diff {param_diff:.1e}, held {held}")


@pytest.mark.timeout(900)
def test_setup_refuses_what_expert_parallelism_cannot_split():
    _run("ep2_zero0")
    for label, _, _, message in REFUSED:
        assert message in _runs["refusals"][label], f"{label}: {_runs['refusals'][label]}"


@pytest.mark.timeout(900)
def test_moe_forward_moves_tokens_by_all_to_all_only():
    """Under ep2 x ZeRO 0, a whole training forward of Mixtral (2 MoE layers) runs per MoE layer one all-to-all of
    expert counts and two of token rows (dispatch, combine) and no other collective: no all-reduce or all-gather of
    expert outputs. Each rows all-to-all sends at most this rank's routes (tokens x top-k x hidden)."""
    _run("ep2_zero0")
    calls = _runs["collectives"]
    names = [name for name, _ in calls]
    assert names == ["c10d.alltoall_base_", *["_c10d_functional.all_to_all_single"] * 2] * 2, names
    config = ZooLM("mixtral").model.config
    routes = GLOBAL_BATCH // 2 * SEQ_LEN * config.num_experts_per_tok
    assert calls[1][1] == routes * config.hidden_size, calls  # the dispatch sends every route of this rank once
    assert all(sent <= 2 * routes * config.hidden_size for _, sent in calls), calls


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(BIAS_LAYOUTS))
def test_bias_balancing_matches_single_process(layout):
    """The reference MoE with DeepSeek-V3's auxiliary-loss-free balancing: per-step loss, every parameter and the
    routers' bias buffers within 1e-5 of one process under ep2 x ZeRO-3, tp2 and pp2 (each layout routes the global
    batch's tokens on different ranks; the counts' all-reduce makes every rank's update the single process's)."""
    _run("ep2_zero0")
    losses, params = _runs["bias balancing"][layout]
    ref_losses, ref_params = _parity.train("reference", model=_bias_balanced())
    biases = [k for k in ref_params if k.endswith("router.expert_bias")]
    assert len(biases) == 2 and any(ref_params[k].abs().sum() > 0 for k in biases), "the biases moved"
    assert_parity((losses, params), (ref_losses, ref_params), f"bias balancing {layout}", rtol=1e-5, loss_rtol=1e-5)
    for key in biases:
        assert torch.equal(params[key], ref_params[key]), (layout, key, params[key], ref_params[key])
