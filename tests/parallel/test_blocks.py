"""Block discovery: the list of transformer blocks is found in the models users bring, and a wrong
override or a model without such a list is refused with the names to choose from."""

import pytest
import torch
from torch import nn

from lightning_llm.modeling.blocks import find_blocks
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


def test_pipeline_placeholders_do_not_break_the_same_class_rule():
    model = Llama(LlamaConfig.from_name("tiny", n_layers=3))
    stand_in = nn.Identity()
    stand_in.is_pipeline_placeholder = True
    model.layers[0] = stand_in  # this stage does not own block 0
    assert find_blocks(model)[1] is model.layers
    model.layers[0] = nn.Identity()  # a real, different class: now the list is mixed
    with pytest.raises(
        ValueError,
        match=r"No nn.ModuleList of same-class blocks found in Llama \(lists of mixed classes: \['layers'\]\)",
    ):
        find_blocks(model)


def test_override_names_the_list_and_bad_overrides_are_refused():
    model = _MoEModel()
    assert find_blocks(model, "layers.1.experts") == ("layers.1.experts", model.layers[1].experts)
    with pytest.raises(
        ValueError, match=r"blocks='layer' names no submodule of _MoEModel; its ModuleLists are \['norms', 'layers'"
    ):
        find_blocks(model, "layer")
    with pytest.raises(ValueError, match="blocks='layers.0' is a _MoEBlock, not a non-empty nn.ModuleList"):
        find_blocks(model, "layers.0")
    model.empty = nn.ModuleList()
    with pytest.raises(ValueError, match="blocks='empty' is a ModuleList, not a non-empty"):
        find_blocks(model, "empty")


def test_a_model_without_blocks_is_refused_with_its_module_names():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(
        ValueError, match=r"No nn.ModuleList .* in Sequential; pass blocks='dotted.name' .*\['0', '1'\]"
    ):
        find_blocks(model)


def test_models_on_the_meta_device_are_searched_without_allocating():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("tiny", n_layers=2))
    name, blocks = find_blocks(model)
    assert name == "layers" and next(blocks.parameters()).is_meta
