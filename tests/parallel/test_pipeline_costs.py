"""The modelled stage FLOPs that balance pipeline stages: by hand, against torch's FLOP counter, and the split they give."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.models.llama import rotary_tables
from lightning_llm.parallel.pipeline.costs import stage_costs
from lightning_llm.parallel.pipeline.gates import outer_modules
from lightning_llm.parallel.pipeline.split import balanced_split

# dim 64, 4 heads of 16 (q, k, v, o: 64 x 64 each), SwiGLU width 128, 4 blocks, vocabulary 768.
CONFIG = LlamaConfig(vocab_size=768, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_hidden_dim=128)


def _costs(seq_len):
    module = CausalLM(CONFIG)
    module.configure_model()  # the reference model is built in configure_model
    name, blocks = find_blocks(module)
    return module, blocks, stage_costs(module, blocks, *outer_modules(module, name), seq_len=seq_len)


def test_stage_costs_by_hand():
    _, _, costs = _costs(seq_len=128)
    # A block: 6 x (4 x 64 x 64 + 3 x 64 x 128) matmul parameters + 12 x 64 x 128 for attention's scores and values.
    assert costs.blocks == [6 * 40960 + 12 * 64 * 128] * 4 == [344064] * 4
    assert costs.first == 2 * 64  # the embedding lookup and its gradient's scatter
    assert costs.last == 6 * 64 * 768 + 8 * 768 == 301056  # head matmul + softmax cross-entropy over 768 logits


def test_block_cost_matches_torch_flop_counter():
    """Independent oracle: torch counts one block's forward matmuls (attention by the math kernel); backward = 2x."""
    _, blocks, costs = _costs(seq_len=32)
    hidden = torch.randn(1, 32, CONFIG.dim)
    cos, sin = rotary_tables(32, CONFIG.head_dim, CONFIG.rope_theta, hidden.device)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        blocks[0](hidden, cos, sin)
    assert 3 * counter.get_total_flops() / 32 == costs.blocks[0]


def test_split_by_flops_differs_from_split_by_parameters():
    """Two stages over 4 blocks, worked by hand (B: a block, H: head and loss, E: embeddings).

    FLOPs at seq_len 128: B = 344064, H = 301056, E = 128. 3|1 costs max(3B + E, B + H) = 1032320,
    2|2 costs max(2B + E, 2B + H) = 989184: 2|2. Parameter counts (what the split used before: a block
    41088 with its norms, the head 64 x 768 + 64 = 49216) give 3|1 max(123264, 90304) = 123264 against
    2|2 = 131392, so 3|1: one stage would do 1.04x the FLOPs of the best split.
    Without the sequence term, B = 245760 and 3|1 (737408) beats 2|2 (792576).
    """
    module, blocks, costs = _costs(seq_len=128)
    assert balanced_split(costs.blocks, 2, head_cost=costs.last, first_cost=costs.first) == [range(0, 2), range(2, 4)]
    by_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    head_params = sum(
        p.numel()
        for n in outer_modules(module, "model.layers")[1]
        for p in module.get_submodule(n).parameters(recurse=False)
    )
    assert (by_params[0], head_params) == (41088, 49216)
    assert balanced_split(by_params, 2, head_cost=head_params) == [range(0, 3), range(3, 4)]
    _, _, no_seq = _costs(seq_len=None)
    assert no_seq.blocks == [245760] * 4
    assert balanced_split(no_seq.blocks, 2, head_cost=no_seq.last, first_cost=no_seq.first) == [
        range(0, 3),
        range(3, 4),
    ]
