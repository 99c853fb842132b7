"""The hidden state inside a block's output, the stand-in outputs of other stages' blocks, and the probe."""

from __future__ import annotations

import logging
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers.utils import ModelOutput

from lightning_llm.parallel.pipeline.block_outputs import BlockOutputs, OutputForm, probe

pytestmark = pytest.mark.timeout(60)

Pair = namedtuple("Pair", "hidden aux")


@dataclass
class PlainOutput:
    hidden: torch.Tensor
    aux: torch.Tensor | None = None


@dataclass
class HFOutput(ModelOutput):
    hidden_states: torch.Tensor | None = None
    attentions: torch.Tensor | None = None


H, AUX = torch.ones(2, 3), torch.zeros(1)


@pytest.mark.parametrize(
    "output",
    [H, (H, AUX), (H,), [H, AUX, AUX], Pair(H, AUX), PlainOutput(H, AUX), HFOutput(hidden_states=H, attentions=AUX)],
    ids=["tensor", "tuple", "1-tuple", "list", "namedtuple", "dataclass", "ModelOutput"],
)
def test_stand_in_outputs_keep_the_structure_with_the_hidden_state_first(output):
    form = OutputForm.of(output, "blocks.0")
    assert form.hidden(output) is H
    other = torch.full((2, 3), 7.0)
    stand_in = form.around(other)
    assert type(stand_in) is type(output)
    assert form.hidden(stand_in) is other
    if form.kind == "sequence":
        assert len(stand_in) == len(output) and all(v is None for v in stand_in[1:])
    if isinstance(output, PlainOutput):
        assert stand_in.aux is None
    if isinstance(output, ModelOutput):
        assert stand_in[0] is other and stand_in.hidden_states is other and stand_in.attentions is None


@pytest.mark.parametrize("output", [{"hidden": H}, (None, H), ("h", H), (), 3.0], ids=str)
def test_outputs_without_a_hidden_state_first_are_refused_naming_the_block(output):
    with pytest.raises(TypeError, match=r"but model\.h\.3 returned \w+ with no tensor there"):
        OutputForm.of(output, "model.h.3")


class _TupleBlock(nn.Module):
    def forward(self, x, attentions=True):
        return x * 2, (x.sum() if attentions else None)


def test_dropped_outputs_are_noted_once_naming_the_block_class(caplog):
    outputs = BlockOutputs()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert outputs.hidden(_TupleBlock(), (H, AUX), "h.0") is H
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "_TupleBlock returns a tuple" in notes[0] and "(element 1)" in notes[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING):  # nothing beside the hidden state (Falcon's (hidden, None)): no note
        BlockOutputs().hidden(_TupleBlock(), (H, None), "h.0")
    assert not caplog.records


def test_a_stand_in_learns_the_structure_from_the_probe_once():
    outputs, probes = BlockOutputs(), []

    def probe_once():
        probes.append(1)
        return _TupleBlock(), (H, AUX)

    first, second = outputs.passed_through(H, probe_once), outputs.passed_through(H + 1, probe_once)
    assert probes == [1] and first == (H, None) and second[1] is None and torch.equal(second[0], H + 1)


class _CachingDropoutBlock(nn.Module):
    """Draws random numbers and appends to a cache, as a Hugging Face block with dropout and use_cache does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(3, 3), nn.Dropout(0.5)

    def forward(self, x, cache=None):
        if cache is not None:
            cache.append(x)
        return self.drop(self.linear(x)), None


class _Cache(list):
    def get_seq_length(self) -> int:
        return len(self)


def test_the_probe_leaves_no_trace():
    block, cache, x = _CachingDropoutBlock(), _Cache(), torch.randn(2, 3, requires_grad=True)
    torch.manual_seed(5)
    hidden, _ = probe(block, (x,), {"cache": cache})
    assert hidden.grad_fn is None  # no autograd graph, hence no gradient from the probe
    assert cache == []  # the real call appends once, as it would have without the probe
    after_probe = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after_probe, torch.rand(4))  # the random stream is where it was
    # By position too, as GPT-2's blocks take it (block(hidden, past_key_values, ...)): on torch 2.11 the probe's
    # keys and values, left in the cache, halved the real call's key/value gradient (GPT-2 under pp2, 2.3e-4 off).
    probe(block, (x, cache), {})
    assert cache == []
