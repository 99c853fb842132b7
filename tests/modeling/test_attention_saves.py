"""What one attention call saves, in the parts context parallelism divides differently, against hand counts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.modeling.activations import measure_block_activations
from lightning_llm.modeling.attention_saves import AttentionSaves

B, H, T, D = 2, 4, 32, 8


class _Attention(nn.Module):
    """q, k, v from one projection, then SDPA with the mask (or causal) the caller gives."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * D, 3 * H * D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attention()])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.layers[0](x, mask)


def _call(mask: torch.Tensor | None) -> AttentionSaves:
    model = _Model()
    x = torch.randn(B, T, H * D)
    sizes = measure_block_activations(model, list(model.layers), lambda: model(x, mask).sum())
    (call,) = sizes[0].attention
    return call


def test_a_causal_call_saves_queries_keys_values_output_and_log_sum_exp():
    # CPU's flash kernel keeps q, k, v, the output (each B x H x T x D, fp32) and the log-sum-exp (B x H x T).
    tensor, lse = B * H * T * D * 4, B * H * T * 4
    call = _call(None)
    assert call == AttentionSaves(total=4 * tensor + lse, keys_values=2 * tensor, mask=0, masked=0, queries=tensor)
    assert call.per_rank(2) == call.total // 2


@pytest.mark.parametrize("batch_rows", [1, B])
def test_a_masked_call_counts_the_mask_it_saves_and_one_row_for_a_broadcast_mask(batch_rows):
    # A boolean mask is kept converted to the queries' dtype (T x T floats per row it has); expanded over the batch
    # (stride 0) it is materialized for the kernel but context parallelism builds one row.
    tensor, lse = B * H * T * D * 4, B * H * T * 4
    window = torch.ones(T, T, dtype=torch.bool).tril() & ~torch.ones(T, T, dtype=torch.bool).tril(-8)
    mask = window[None, None].expand(B, 1, T, T) if batch_rows == 1 else window[None, None].repeat(B, 1, 1, 1)
    call = _call(mask)
    saved_mask = B * T * T * 4
    assert call == AttentionSaves(
        total=4 * tensor + lse + saved_mask,
        keys_values=2 * tensor,
        mask=saved_mask,
        masked=batch_rows * T * T * 4,
        queries=tensor,
    )


def test_per_rank_bytes_of_a_masked_call_by_hand():
    # cp=2: chunks of c = T/4 queries; rank 0 holds chunks 0 and 3 (keys c and 4c), rank 1 chunks 1 and 2 (2c, 3c):
    # 5c^2 mask entries each, 5/16 of T^2. The keys and values stay whole; the rest is halved; the chunks' outputs
    # are concatenated into a copy of the rank's output (the queries' bytes / C).
    call = AttentionSaves(total=1000, keys_values=300, mask=400, masked=1600, queries=120)
    assert call.per_rank(1) == 1000
    assert call.per_rank(2) == (1000 - 300 - 400) // 2 + 300 + 1600 * 5 // 16 + 120 // 2
    # cp=4: chunk pairs (r, 7 - r) over (r + 1) c and (8 - r) c keys: 9c^2 of the (8c)^2 = 64c^2 whole.
    assert call.per_rank(4) == 300 // 4 + 300 + 1600 * 9 // 64 + 120 // 4
    assert AttentionSaves(total=1000, keys_values=300).per_rank(4) == 250


def test_the_rings_backward_buffers_by_hand():
    # Per rank, 1/cp of: dq and half a block's dq (1.5 q), the travelling k, v, dk, dv (4 x k), half a block's dk, dv
    # and the kernel's contiguous copies of a block's k, v (1 x k); grouped heads are never repeated.
    call = AttentionSaves(total=0, keys_values=200, queries=400)
    assert call.ring_buffers(1) == 0
    assert call.ring_buffers(2) == (600 + 4 * 100 + 100) // 2
    assert AttentionSaves(total=0, keys_values=200, masked=64, queries=400).ring_buffers(2) == 0  # no ring: gathered


def test_documents_and_a_batch_of_ones_own_are_refused_together():
    from lightning_llm.modeling.activations import measure_model_activations

    with pytest.raises(ValueError, match="documents=True or a batch_fn, not both"):
        measure_model_activations(nn.Linear(2, 2), micro_batch_size=1, seq_len=8, batch_fn=torch.zeros, documents=True)
