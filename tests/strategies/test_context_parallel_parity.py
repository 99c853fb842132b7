"""Context parallelism against one process: HF Llama, a partial-rotary HF model (GPT-NeoX, rotary_pct=0.5) and the
reference model, fp32: per-step loss and every parameter within 1e-5 relative of the single process, parameters
bit-identical on every rank that holds them, and each rank's attention kernel computing exactly its own zig-zag
queries (Ulysses: every position, for half the heads). Layouts: on 2 ranks cp2 (ZeRO 0, replicated over the CP
ranks), cp2 + ZeRO-3 (FSDP over ``dp_shard_cp`` = 2), Ulysses cp2 + ZeRO-3, cp2 + ZeRO-3 + selective activation
checkpointing; on 4 ranks cp2 × tp2 (+ ZeRO-3 over the CP ranks) and dp2 × cp2 (ZeRO-3 over ``dp_shard_cp`` = 4).

One spawned process group trains every case (starting the ranks costs more than the tiny models).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_llm.parallel.cp import count_queries, zigzag_positions
from lightning_llm.testing import run_distributed
from tests.strategies import _parity
from tests.strategies._parity import assert_parity
from tests.zoo import _harness

pytestmark = [pytest.mark.distributed]

LAYOUTS = {
    "cp2": (2, {"context_parallel_size": 2, "zero_stage": 0}),
    "cp2_zero3": (2, {"context_parallel_size": 2}),
    "cp2_ulysses_zero3": (2, {"context_parallel_size": 2, "context_parallel_method": "ulysses"}),
    "cp2_zero3_ac": (2, {"context_parallel_size": 2, "activation_checkpointing": "selective"}),  # recompute rings too
    "cp2_tp2": (4, {"context_parallel_size": 2, "tensor_parallel_size": 2}),  # ZeRO-3 over dp_shard_cp = 2 too
    "dp2_cp2_zero3": (4, {"context_parallel_size": 2}),  # 2 data-parallel replicas, FSDP over dp_shard_cp = 4
}
MODELS = ["llama", "gpt_neox", "reference"]
REFERENCE_SEQ = 32  # the reference model reads seq_len + 1 tokens and trains on 32; the zoo trains on 16


def _differing(model) -> list[str]:
    state = _harness._local_state(model)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return sorted(k for k, v in state.items() if any(not torch.equal(s[k], v) for s in states))


def _train(name: str, layout: str):
    from lightning_llm.strategies import LLMParallelStrategy

    devices, kwargs = LAYOUTS[layout]
    dp = devices // kwargs["context_parallel_size"] // kwargs.get("tensor_parallel_size", 1)
    strategy = LLMParallelStrategy(**kwargs)
    if name != "reference":
        losses, params, differing, *_ = _harness.train(name, strategy, devices=devices, dp=dp)
        return losses, params, differing
    model = _parity.make_model("reference")
    losses, params = _parity.train("reference", strategy, devices=devices, dp=dp, model=model)
    return losses, params, _differing(model)


def _cp_cases(layouts: list[str], models: list[str]) -> dict:
    """On each rank: {(layout, model): (losses, params, differing, query positions the kernel saw)}."""
    results = {}
    for layout in layouts:
        for name in models:
            seen: list[int] = []
            with count_queries(lambda positions, keys: seen.extend(positions.tolist())):
                result = _train(name, layout)
            results[(layout, name)] = (*result, sorted(set(seen)))
    return results


_runs: dict = {}


def _results(world_size: int) -> list[dict]:
    if world_size not in _runs:
        layouts = [name for name, (size, _) in LAYOUTS.items() if size == world_size]
        _runs[world_size] = run_distributed(_cp_cases, world_size, layouts, MODELS, timeout=840)
    return _runs[world_size]


def _reference(name: str):
    if name == "reference":
        return _parity.train("reference")
    return _harness.train(name)[:2]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_matches_single_process(layout, name):
    ranks = _results(LAYOUTS[layout][0])
    losses, params, differing, _ = ranks[0][(layout, name)]
    ref_losses, ref_params = _reference(name)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_error = max(((params[k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref_params.items())
    print(f"{name} {layout}: max loss rel diff {loss_error:.1e}, max param rel diff {param_error:.1e}")
    assert not differing, f"{name} {layout}: replicated parameters differ between the CP ranks: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), f"{name} {layout}", rtol=1e-5)
    seq = REFERENCE_SEQ if name == "reference" else _harness.SEQ_LEN
    tp = LAYOUTS[layout][1].get("tensor_parallel_size", 1)
    for rank, results in enumerate(ranks):  # each rank's kernel saw exactly its own shard's queries (cp rank below)
        seen = results[(layout, name)][3]
        ulysses = LAYOUTS[layout][1].get("context_parallel_method") == "ulysses"  # all positions, heads / 2 heads
        cp_rank = rank // tp % 2  # mesh (dp_shard, cp, tp), tp innermost
        assert seen == (list(range(seq)) if ulysses else zigzag_positions(seq, 2, cp_rank).tolist()), (rank, seen)
