"""Block discovery: the list of transformer blocks is found in the models users bring (hybrids of mixed block
classes and Sequentials included), and a wrong override or a model without such a list is refused with the names
to choose from. Mixed-class models end to end: tests/zoo/test_hybrid_blocks.py."""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_llm.modeling.blocks import block_modules, block_names, find_blocks
from lightning_llm.models import CausalLM, Llama, LlamaConfig
from lightning_llm.testing.models import HFCausalLM, UserLM


def _reference():
    module = CausalLM(LlamaConfig.from_name("tiny", n_layers=3))
    module.configure_model()
    return module


@pytest.mark.parametrize(
    "build, name, block_class",
    [
        (_reference, "model.layers", "TransformerBlock"),
        (lambda: HFCausalLM("llama", layers=3), "model.model.layers", "LlamaDecoderLayer"),
        (lambda: HFCausalLM("gpt2", layers=3), "model.transformer.h", "GPT2Block"),
        (lambda: UserLM(layers=3), "blocks", "_UserBlock"),
    ],
    ids=["reference", "hf_llama", "hf_gpt2", "user"],
)
def test_blocks_are_found_in_every_kind_of_model(build, name, block_class):
    module = build()
    found, blocks = find_blocks(module)
    assert found == name
    assert blocks is module.get_submodule(name)
    assert len(blocks) == 3 and {type(b).__name__ for b in blocks} == {block_class}


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)


class _MoEBlock(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.experts = nn.ModuleList(_Expert() for _ in range(experts))


class _MoEModel(nn.Module):
    """Two layers of eight experts each: the longest same-class list is one layer's experts."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(8), nn.RMSNorm(8)])  # mixed classes: never blocks
        self.layers = nn.ModuleList(_MoEBlock(8) for _ in range(2))


def test_the_list_holding_most_parameters_wins_over_a_longer_list_of_experts():
    model = _MoEModel()
    assert len(model.layers[0].experts) > len(model.layers)
    name, blocks = find_blocks(model)
    assert (name, blocks) == ("layers", model.layers)


def test_equal_parameter_counts_fall_back_to_the_longer_list():
    model = nn.Module()
    model.short = nn.ModuleList([nn.Linear(4, 8)])
    model.long = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # 2 * 20 parameters vs 40
    assert find_blocks(model)[0] == "long"


def test_override_names_the_list_and_bad_overrides_are_refused():
    model = _MoEModel()
    assert find_blocks(model, "layers.1.experts") == ("layers.1.experts", model.layers[1].experts)
    with pytest.raises(
        ValueError,
        match=r"blocks='layer' names no submodule of _MoEModel; its ModuleLists and Sequentials are \['norms', 'layers'",
    ):
        find_blocks(model, "layer")
    with pytest.raises(ValueError, match="blocks='layers.0' is a _MoEBlock, not a non-empty nn.ModuleList, nn.Seq"):
        find_blocks(model, "layers.0")
    model.empty = nn.ModuleList()
    with pytest.raises(ValueError, match="blocks='empty' is a ModuleList, not a non-empty"):
        find_blocks(model, "empty")


def test_a_model_without_a_block_container_gets_its_units_not_a_refusal():
    # The model itself is never its own blocks: below it, the one child with parameters is a lone layer (its unit).
    name, units = find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert (name, units.names) == ("", ["0"])
    # Wrappers holding one child are looked through; then each child with parameters is a unit.
    wrapped = nn.Module()
    wrapped.net = nn.Module()
    wrapped.net.embed, wrapped.net.act, wrapped.net.head = nn.Embedding(4, 2), nn.ReLU(), nn.Linear(2, 4)
    assert find_blocks(wrapped)[1].names == ["net.embed", "net.head"]


def test_models_on_the_meta_device_are_searched_without_allocating():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
    name, blocks = find_blocks(model)
    assert name == "layers" and next(blocks.parameters()).is_meta


class _Mixer(nn.Module):
    """A Mamba-like block: no query projection, a different class from _MoEBlock."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(8, 16)
        self.out_proj = nn.Linear(16, 8)


@pytest.mark.timeout(60)
def test_blocks_of_mixed_classes_are_found_as_the_list_holding_most_parameters():
    model = nn.Module()
    model.layers = nn.ModuleList([_Mixer(), _MoEBlock(2), _Mixer(), _MoEBlock(2)])
    model.heads = nn.ModuleList([nn.Linear(8, 16), nn.Linear(8, 16)])  # one class, fewer parameters
    name, blocks = find_blocks(model)
    assert (name, blocks) == ("layers", model.layers)
    assert [type(b).__name__ for b in block_modules(blocks)] == ["_Mixer", "_MoEBlock", "_Mixer", "_MoEBlock"]


@pytest.mark.timeout(60)
def test_pipeline_placeholders_in_a_list_of_blocks_keep_it_the_blocks():
    model = Llama(LlamaConfig.from_name("tiny", n_layers=3))
    stand_in = nn.Identity()
    stand_in.is_pipeline_placeholder = True  # this stage does not own block 0: it holds no parameters
    model.layers[0] = stand_in
    assert find_blocks(model)[1] is model.layers


@pytest.mark.timeout(60)
def test_a_sequential_of_blocks_is_found_and_its_blocks_named_by_its_keys():
    model = nn.Module()
    model.embed = nn.Embedding(16, 8)
    model.stack = nn.Sequential(OrderedDict(mix=_Mixer(), moe=_MoEBlock(2), mix2=_Mixer()))
    name, blocks = find_blocks(model)
    assert (name, blocks) == ("stack", model.stack)
    assert block_names(name, blocks) == ["stack.mix", "stack.moe", "stack.mix2"]
    assert find_blocks(model, "stack") == ("stack", model.stack)


@pytest.mark.timeout(60)
def test_a_whole_model_written_as_a_sequential_is_not_its_blocks():
    model = nn.Module()
    blocks = nn.Sequential(_Mixer(), _Mixer())
    model.net = nn.Sequential(nn.Embedding(1000, 8), blocks, nn.Linear(8, 1000))  # holds everything
    assert find_blocks(model) == ("net.1", blocks)


@pytest.mark.timeout(60)
def test_blocks_in_a_module_dict_are_its_entries_in_order():
    model = nn.Module()
    model.embed = nn.Embedding(16, 8)
    model.layers = nn.ModuleDict({"0": _Mixer(), "1": _Mixer()})  # torchtitan's layout
    for override in (None, "layers"):
        name, blocks = find_blocks(model, override)
        assert (name, blocks.names, blocks.container) == ("layers", ["layers.0", "layers.1"], "layers")
        assert list(blocks) == [model.layers["0"], model.layers["1"]]
