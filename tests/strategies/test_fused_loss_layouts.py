"""The reference model's chunked loss under each layout: used where it holds, and training as one process does
with the plain loss.

``CausalLM(loss_chunk_size=7)`` splits every micro-batch's 32 or 64 tokens into uneven chunks. Under ZeRO 0 and 3
the head's weight is gathered by FSDP2 inside the root's forward; under pipeline parallelism the head is an FSDP unit
of its own on the last stage, called through its hooks (``head_cross_entropy``); under tensor parallelism the head's
vocabulary is split and the model keeps its gathered logits and ``F.cross_entropy``. Oracle: one process with
``fused_cross_entropy=False`` (whole logits), fp32, the parity tolerances of tests/strategies/_parity.py; and a count
of the fused loss's calls on each rank, so a silent fallback to whole logits fails the test.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import run_distributed
from tests.strategies._parity import STEPS, assert_parity, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {
    "dp2-zero0": ({"zero_stage": 0}, [True, True]),
    "dp2-zero3": ({"zero_stage": 3}, [True, True]),
    "tp2": ({"tensor_parallel_size": 2}, [False, False]),
    "pp2-1f1b": ({"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "num_microbatches": 2}, [False, True]),
}


def _model(fused: bool) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(
        LlamaConfig.from_name("tiny"), warmup_steps=2, max_steps=STEPS, fused_cross_entropy=fused, loss_chunk_size=7
    )
    module.configure_model()
    return module


def _train_counting_fused_calls(layouts: list[dict]) -> list:
    import lightning_llm.models.module as causal_lm
    from lightning_llm.strategies import LLMParallelStrategy

    calls, original = [], causal_lm.head_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    causal_lm.head_cross_entropy = counted
    results = []
    for layout in layouts:
        calls.clear()
        dp = 2 // layout.get("tensor_parallel_size", 1) // layout.get("pipeline_parallel_size", 1)
        result = train("reference", LLMParallelStrategy(**layout), devices=2, dp=dp, model=_model(fused=True))
        counts = [None, None]
        dist.all_gather_object(counts, len(calls))
        results.append((result, [n > 0 for n in counts]))
    return results if dist.get_rank() == 0 else None


def test_chunked_loss_trains_like_whole_logits_in_one_process_and_is_used_where_it_holds():
    layouts = [layout for layout, _ in LAYOUTS.values()]
    results = run_distributed(_train_counting_fused_calls, 2, layouts, timeout=540)[0]
    reference = train("reference", model=_model(fused=False))
    for (label, (_, used)), (result, fused_on_rank) in zip(LAYOUTS.items(), results):
        assert fused_on_rank == used, f"{label}: chunked loss used per rank {fused_on_rank}, expected {used}"
        assert_parity(result, reference, label)
