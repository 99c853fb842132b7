"""Per-head modules under tensor parallelism: a list of one LayerNorm per head (StableLM 2's q/k norms) is split
with the heads, and models that pair heads across groups stay refused before the first step.

The StableLM case is StableLM 2 12B's options at tiny sizes (``qk_layernorm=True, use_parallel_residual=True``, 4
heads, 2 KV heads), each head's norm drawn apart so that a norm applied to another head shows at step 1. The
oracle is one process: 10 steps, per-step loss and every parameter within 1e-5 (fp32), every parameter identical on
the ranks holding it. Which norms each rank runs is read with forward hooks on the norms themselves.
"""

from __future__ import annotations

import re

import pytest
import torch

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity
from tests.zoo._harness import train, train_zoo
from tests.zoo._models import _DENSE, BUILDERS, ZooLM, _hf
from tests.zoo._models_more import stablelm_per_head_norms

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
STEPS = 10
LAYOUTS = {"tp2": {"tensor_parallel_size": 2}, "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True}}
PAIRED = {  # heads paired across halves (DiffLlama), a norm over all heads between the split layers (BitNet)
    "diffllama": lambda: _hf("DiffLlamaConfig", "DiffLlamaForCausalLM", **_DENSE),
    "bitnet": lambda: _hf("BitNetConfig", "BitNetForCausalLM", **_DENSE),
}


def _register() -> None:
    BUILDERS.update({"stablelm_qk_norms": stablelm_per_head_norms, **PAIRED})


def _norms_run(layout_kwargs: dict) -> list[list[str]]:
    """Which per-head norms of the first block's attention each rank runs in one forward (by their own names)."""
    from lightning_llm.strategies import LLMParallelStrategy
    from lightning_llm.testing import cpu_trainer

    torch.manual_seed(0)
    model = ZooLM("stablelm_qk_norms")
    attention = model.model.model.layers[0].self_attn
    ran: list[str] = []
    for kind in ("q_layernorm", "k_layernorm"):
        for index, norm in enumerate(getattr(attention, kind).norms):
            # The setup's structure trace (meta or fake tensors) and the first forward's check of the split attention
            # against the whole one run without autograd: only the training forward's calls count.
            record = lambda m, a, o, name=f"{kind}.norms.{index}": torch.is_grad_enabled() and ran.append(name)  # noqa: E731
            norm.register_forward_hook(record)
    trainer = cpu_trainer(devices=2, strategy=LLMParallelStrategy(**layout_kwargs), max_steps=1)
    trainer.fit(model, torch.utils.data.DataLoader(torch.randint(0, 128, (4, 16)), batch_size=2))
    return ran


def _ranks() -> dict:
    import torch.distributed as dist

    _register()
    results = {layout: _train_steps(layout) for layout in LAYOUTS}
    results["refused"] = train_zoo(["tp2"], list(PAIRED))
    ran = [None] * dist.get_world_size()
    dist.all_gather_object(ran, _norms_run(LAYOUTS["tp2"]))
    results["ran"] = ran
    return results if dist.get_rank() == 0 else None


def _train_steps(layout: str):
    from lightning_llm.strategies import LLMParallelStrategy

    return train("stablelm_qk_norms", LLMParallelStrategy(**LAYOUTS[layout]), devices=2, steps=STEPS)


_runs: dict = {}


def _results() -> dict:
    if not _runs:
        _runs.update(run_distributed(_ranks, 2, timeout=540)[0])
    return _runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_head_norms_split_with_their_heads_match_one_process(layout):
    losses, params, differing, _, held = _results()[layout]
    _register()
    reference = train("stablelm_qk_norms", steps=STEPS)
    assert not differing, f"parameters differ between the ranks holding them: {differing}"
    assert_parity((losses, params), reference[:2], f"stablelm per-head norms {layout}", rtol=1e-5, loss_rtol=1e-5)
    assert held["attention"] <= 0.55, held


def test_each_rank_runs_the_norms_of_its_own_heads():
    # 4 query heads and 2 key/value heads over tp=2: rank 0 holds heads 0-1 (kv head 0), rank 1 heads 2-3 (kv 1).
    # One forward in the training step (and none else: no activation checkpointing recompute).
    rank0, rank1 = (sorted(set(ran)) for ran in _results()["ran"])
    assert rank0 == ["k_layernorm.norms.0", "q_layernorm.norms.0", "q_layernorm.norms.1"]
    assert rank1 == ["k_layernorm.norms.1", "q_layernorm.norms.2", "q_layernorm.norms.3"]


@pytest.mark.parametrize(
    "name, cause",
    [
        ("diffllama", r"cuts its heads into groups \(chunk along the head axis"),
        ("bitnet", r"attn_sub_norm has 32-wide parameters but runs on this rank's 16 columns"),
    ],
)
def test_models_that_pair_heads_stay_refused_before_the_first_step(name, cause):
    error = _results()["refused"]["tp2"][name]
    assert isinstance(error, str), f"{name} trained under tp2 without a refusal"
    assert re.search(cause, error), error
    assert "tensor_parallel_replicate=" in error
