"""One tensor-parallel rank's share of the activations, read from the dataflow, against a count by hand.

The model is a residual MLP block: ``x + down(gelu(up(norm(x))))`` with ``up`` a column split and ``down`` a row
split, then a head whose output is gathered. What autograd saves in it is known (``torch.nn.functional``'s
backward formulas), so each tensor's place can be counted by hand: the norm's input and statistics are the stream
(whole without sequence parallelism, 1/tp with it); ``up`` keeps its input, which is the norm's output (whole; under
sequence parallelism ``up`` gathers its own copy); gelu's input and ``down``'s input are inside the region (1/tp);
the head keeps its input (whole) and the loss the gathered logits (whole).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llm.modeling.activations import measure_blocks
from lightning_llm.modeling.tp_shares import TensorParallelShares

B, T, D, F, V, TP = 2, 8, 16, 64, 32, 4
FP32 = 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, F), nn.Linear(F, D)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block()])
        self.head = nn.Linear(D, V)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).logsumexp(-1).sum()


def _count(sequence_parallel: bool | None):
    torch.manual_seed(0)
    model = _Model()
    block = model.layers[0]
    shares = (
        None
        if sequence_parallel is None
        else TensorParallelShares(
            TP, sequence_parallel, {block.up: "opens", block.down: "closes", model.head: "gathers"}
        )
    )
    x = torch.randn(B, T, D, requires_grad=True)
    return measure_blocks(model.layers, lambda: model(x), shares=shares)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_blocks_per_rank_bytes_match_a_count_by_hand(sequence_parallel):
    stream_tensor, hidden = B * T * D * FP32, B * T * F * FP32
    stats = 2 * B * T * FP32  # layer norm's mean and rstd
    whole = _count(None)[0].saved
    # The norm's input and statistics, up's input (the norm's output), gelu's input, down's input.
    assert whole == 2 * stream_tensor + stats + 2 * hidden

    got = _count(sequence_parallel)[0]
    stream = (stream_tensor + stats) / (TP if sequence_parallel else 1)
    assert got.saved == pytest.approx(stream + stream_tensor + 2 * hidden / TP, abs=4)
    assert got.input == pytest.approx(stream_tensor / (TP if sequence_parallel else 1), abs=1)


def test_outside_the_blocks_a_gathered_heads_input_and_output_are_whole():
    # The head's input and the logits logsumexp keeps (its output too) are whole on every rank, with or without SP.
    logits = B * T * V * FP32
    for sequence_parallel in (False, True):
        assert _count(sequence_parallel).outside == _count(None).outside
    assert _count(None).outside >= logits


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match="Unknown tensor-parallel roles"):
        TensorParallelShares(2, False, {nn.Linear(2, 2): "colwise"})
