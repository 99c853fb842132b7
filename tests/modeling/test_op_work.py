"""The work one rank does in a forward, recorded on fake tensors (:mod:`lightning_llm.modeling.op_work`).

Oracles: torch's ``FlopCounterMode`` on a real forward (the FLOPs), the tensor-parallel plan's split of every matmul
of a Llama block (half of each at tp=2), and torch's styles counted by hand (the collectives per block).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_llm.modeling.op_work import forward_work
from lightning_llm.parallel.tp.model_plan import planned_shares

B, T = 2, 32


def _model():
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("tiny", n_layers=2))
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    return module


def _work(tp: int = 1, sequence_parallel: bool = False):
    module = _model()
    batch = torch.zeros(B, T + 1, dtype=torch.long)
    shares = planned_shares(module, tp=tp, sequence_parallel=sequence_parallel) if tp > 1 else None
    return forward_work(module, lambda: module.training_step(batch, 0), shares=shares)


def test_forward_flops_are_torchs_count_of_a_real_forward():
    module = _model()
    batch = torch.randint(0, 256, (B, T + 1))
    with FlopCounterMode(display=False) as counter:
        module.training_step(batch, 0)
    assert _work().total.matmul_flops == counter.get_total_flops()


def test_a_blocks_dispatches_are_the_ops_selective_checkpointings_policy_sees():
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    module, seen = _model(), []

    def policy(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    block = module.model.layers[0]
    forward = block.forward
    block.forward = lambda *a, **k: checkpoint(
        forward, *a, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy), **k
    )
    module.training_step(torch.randint(0, 256, (B, T + 1)), 0)
    recorded = _work().blocks[0]
    assert recorded.dispatches == len(seen) and recorded.ops < recorded.dispatches


def test_under_tensor_parallelism_a_rank_does_half_of_every_blocks_matmuls():
    whole, split = _work(), _work(tp=2)
    for got, full in zip(split.blocks, whole.blocks):
        assert got.matmul_flops == full.matmul_flops / 2
        assert got.ops == full.ops


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_block_makes_the_collectives_torchs_styles_make(sequence_parallel):
    # A Llama block: q, k, v, gate, up are column splits; o and down are row splits.
    hidden = B * T * 64 * 4  # fp32 hidden states (tiny preset: width 64)
    per_block = Counter((phase, kind) for phase, kind, nbytes, block in _work(2, sequence_parallel).collectives
                        if block == 0 and nbytes == hidden)  # fmt: skip
    if sequence_parallel:
        want = {("forward", "all_gather"): 5, ("forward", "reduce_scatter"): 2,
                ("backward", "reduce_scatter"): 5, ("backward", "all_gather"): 2}  # fmt: skip
    else:
        want = {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 5}
    assert dict(per_block) == want


def test_attention_keys_and_values_and_the_hidden_states_are_recorded():
    work = _work()
    assert work.stream_bytes == B * T * 64 * 4
    assert all(kv > 0 for kv in work.attention_kv_bytes) and len(work.attention_kv_bytes) == 2


def _torchs_collectives() -> dict[bool, dict[str, int]] | None:
    """Collectives torch's DTensor makes in one tensor-parallel step (fwd + bwd), by kind, counted by CommDebugMode,
    without and with sequence parallelism."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize

    dims = ParallelDims(world_size=2, tp=2)
    dims.build_mesh("cpu")
    counts = {}
    for sequence_parallel in (False, True):
        module = _model()
        parallelize(module, dims, zero_stage=0, sequence_parallel=sequence_parallel)
        batch = torch.randint(0, 256, (B, T + 1))
        module.training_step(batch, 0).backward()  # the first forward's parity checks make their own
        with CommDebugMode() as comm:
            module.training_step(batch, 0).backward()
        counts[sequence_parallel] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return counts if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def torchs_collectives():
    from lightning_llm.testing import run_distributed

    return run_distributed(_torchs_collectives, 2, timeout=240)[0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_recorded_collectives_are_those_torch_makes_in_a_real_step(torchs_collectives, sequence_parallel):
    real = torchs_collectives[sequence_parallel]
    names = {
        "all_reduce": "all_reduce",
        "all_gather": "all_gather_into_tensor",
        "reduce_scatter": "reduce_scatter_tensor",
    }
    recorded = Counter(names[kind] for _, kind, _, _ in _work(2, sequence_parallel).collectives)
    assert dict(recorded) == real


def test_a_deep_stack_recorded_on_two_blocks_equals_recording_every_block():
    from lightning_llm.modeling import op_work

    module = _model()  # 2 blocks: recorded whole; a 6-block model is sampled on its first two
    from lightning_llm.models import CausalLM, LlamaConfig

    torch.manual_seed(0)
    deep = CausalLM(LlamaConfig.from_name("tiny", n_layers=6))
    deep.configure_model()
    deep.log = module.log
    batch = torch.zeros(B, T + 1, dtype=torch.long)
    shares = planned_shares(deep, tp=2, sequence_parallel=True)
    sampled = forward_work(deep, lambda: deep.training_step(batch, 0), shares=shares)
    blocks = list(deep.model.layers)
    every = op_work._record(deep, blocks, lambda: deep.training_step(batch, 0), shares, None)
    assert sampled.blocks == every.blocks and sampled.outside == every.outside
    assert Counter(sampled.collectives) == Counter(every.collectives)
    assert sampled.attention_kv_bytes == every.attention_kv_bytes and sampled.stream_bytes == every.stream_bytes


def test_an_moe_blocks_routed_rows_and_expert_work_are_what_its_experts_do():
    from lightning_llm.models import CausalLM, LlamaConfig
    from lightning_llm.models.moe import Experts

    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("tiny-moe", n_layers=2))
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    config = module.config
    work = forward_work(module, lambda: module.training_step(torch.zeros(B, T + 1, dtype=torch.long), 0))
    # one row per token and chosen expert, the model's width in fp32 (a count by hand)
    assert work.routed_bytes == [B * T * config.top_k * config.dim * 4] * 2
    # the experts' own matmuls are torch's count of a real call of an experts module on as many routes
    experts = next(m for m in module.modules() if isinstance(m, Experts))
    hidden = torch.randn(B * T, config.dim)
    ids = torch.randint(0, config.n_experts, (B * T, config.top_k))
    with FlopCounterMode(display=False) as counter:
        experts(hidden, ids, torch.rand(B * T, config.top_k))
    assert [part.matmul_flops for part in work.experts] == [counter.get_total_flops()] * 2
    assert all(0 < part.ops < block.ops for part, block in zip(work.experts, work.blocks))
    # backward: each expert's slice of a stacked weight gets its gradient as a zero-filled whole, then added
    stacked = sum(p.numel() * 4 for p in experts.parameters())
    assert [part.backward_bytes for part in work.experts] == [2 * config.n_experts * stacked] * 2
    assert [block.backward_bytes for block in work.blocks] == [2 * config.n_experts * stacked] * 2
    # outside the blocks, the embedding's one lookup fills a whole zero gradient (the head's matmul fills none)
    assert work.outside.backward_bytes == module.model.tok_embeddings.weight.numel() * 4
