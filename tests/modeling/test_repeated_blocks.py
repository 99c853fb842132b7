"""Two measured blocks stand for a stack of identical ones: equal to measuring every block, and flat in depth."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_llm.modeling.activations import activation_bytes_by_mode, measure_block_activations
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.modeling.repeated_blocks import identical_blocks, measure_repeated
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.parallel.activation_checkpointing import saves_output
from lightning_llm.testing.models import HFCausalLM, UserLM

LAYERS = 5
TOKENS = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
DOCUMENTS = torch.tensor([[0] * 10 + [1] * 23, [0] * 20 + [1] * 13])


def _module(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "reference":
        module = CausalLM(LlamaConfig.from_name("tiny", n_layers=LAYERS))
        module.configure_model()
    elif arch == "hf_llama":  # blocks differ in their layer_idx only
        module = HFCausalLM("llama", layers=LAYERS)
    else:
        module = UserLM(layers=LAYERS)
    module.log = lambda *args, **kwargs: None
    return module


# Document ids: the reference model passes a block-diagonal mask to every block.
@pytest.mark.parametrize(
    ("arch", "documents"), [("reference", False), ("reference", True), ("hf_llama", False), ("user", False)]
)
def test_two_blocks_give_what_measuring_every_block_gives(arch, documents):
    module = _module(arch)
    batch = {"input_ids": TOKENS, "document_ids": DOCUMENTS} if documents else TOKENS
    name, blocks = find_blocks(module)

    def step():
        return module.training_step(batch, 0)

    # The oracle: one forward through all blocks, each measured (saved bytes, input, selective-policy bytes).
    full = measure_block_activations(module, list(blocks), step, saves_output)
    sampled = measure_repeated(
        module, name, blocks, lambda sample: measure_block_activations(module, sample, step, saves_output)
    )
    assert sampled == full
    assert len(find_blocks(module)[1]) == LAYERS  # the block list is put back


def test_planning_runs_two_blocks_whatever_the_depth():
    calls = []
    for layers in (4, 32):
        with torch.device("meta"):
            module = CausalLM(LlamaConfig.from_name("7B", n_layers=layers))
            module.configure_model()
        module.log = lambda *args, **kwargs: None
        blocks = find_blocks(module)[1]
        ran = [0]
        for block in blocks:
            block.register_forward_pre_hook(lambda *_: ran.__setitem__(0, ran[0] + 1))
        activation_bytes_by_mode(module, micro_batch_size=1, seq_len=256)
        calls.append(ran[0])
    assert calls == [2, 2]  # one forward through the first two blocks, at 4 layers as at 32


def test_blocks_that_differ_are_measured_in_full():
    module = _module("reference")
    name, blocks = find_blocks(module)
    assert identical_blocks(blocks)
    blocks[3].attention.sliding_window = 8  # a setting that could change what the block saves
    assert not identical_blocks(blocks)
    assert measure_repeated(module, name, blocks, lambda sample: pytest.fail("must not measure a sample")) is None


class _CountsItsLayers(CausalLM):
    """A forward that insists on its full depth: the shortened forward fails, the full measurement is used."""

    def forward(self, tokens, document_ids=None):
        assert len(self.model.layers) == LAYERS, "this model runs only at its full depth"
        return super().forward(tokens, document_ids)


def test_a_forward_that_needs_every_block_falls_back_to_measuring_all():
    module = _CountsItsLayers(LlamaConfig.from_name("tiny", n_layers=LAYERS))
    module.configure_model()
    module.log = lambda *args, **kwargs: None
    name, blocks = find_blocks(module)
    assert (
        measure_repeated(
            module,
            name,
            blocks,
            lambda sample: measure_block_activations(module, sample, lambda: module.training_step(TOKENS, 0)),
        )
        is None
    )
    got = activation_bytes_by_mode(module, micro_batch_size=2, seq_len=32)
    full = measure_block_activations(
        module, list(blocks), lambda: module.training_step(torch.zeros(2, 33, dtype=torch.long), 0)
    )
    assert got == (sum(s.saved for s in full), sum(s.input for s in full) + max(s.saved for s in full))
