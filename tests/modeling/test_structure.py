"""The blocks read off a model's forward (:mod:`lightning_llm.modeling.structure`), whatever holds them, against the
structure each toy model is built with; and a traced forward leaves nothing of its own on the model."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_llm.modeling.blocks import entry_modules, find_blocks
from lightning_llm.modeling.structure import traced_blocks

DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.norm(x))


class DictModel(nn.Module):
    """torchtitan's and OLMo-core's layout: blocks keyed "0", "1", ... in an ``nn.ModuleDict``."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, DIM), nn.Linear(DIM, 16)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


class SlotModel(nn.Module):
    """x-transformers' layout: each layer a list of ``[norm, mixer, None]`` slots, called from the stack's forward."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, DIM), nn.Linear(DIM, 16)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(DIM), nn.Linear(DIM, DIM), None]) for _ in range(layers)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for norm, mixer, _ in self.layers:
            x = x + mixer(norm(x))
        return self.head(x)


class AttributeModel(nn.Module):
    """Blocks held as attributes, called one after another."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, DIM), nn.Linear(DIM, 16)
        self.first, self.second, self.third = Block(), Block(), Block()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.third(self.second(self.first(self.embed(ids)))))


class Bypassed(Block):
    def run(self, x: torch.Tensor) -> torch.Tensor:  # the model calls this, not forward (RetNet's forward_parallel)
        return x + self.mix(self.norm(x))


class BypassModel(DictModel):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Bypassed() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer.run(x)
        return self.head(x)


def _trace(model: nn.Module):
    ids = torch.randint(0, 16, (2, 5))
    return traced_blocks(model, lambda move: model(move(ids)))


def test_blocks_in_a_module_dict_are_the_dict_entries_in_call_order():
    blocks = _trace(DictModel())
    assert blocks.container == "layers" and blocks.names == ["layers.0", "layers.1", "layers.2"]
    name, found = find_blocks(DictModel(), blocks.override(DictModel()))
    assert name == "layers" and found.names == blocks.names and found.container == "layers"


def test_layers_of_slots_are_blocks_entered_through_their_slots():
    model = SlotModel()
    blocks = _trace(model)
    assert blocks.names == ["layers.0", "layers.1"]
    assert blocks.bypassed() == {"layers.0": ["layers.0.0", "layers.0.1"], "layers.1": ["layers.1.0", "layers.1.1"]}
    # Without a trace, the slots with a forward of their own (the None slot skipped) are the entries too.
    assert entry_modules(model.layers[0]) == [model.layers[0][0], model.layers[0][1]]


def test_attribute_blocks_of_one_class_called_in_sequence():
    blocks = _trace(AttributeModel())
    assert blocks.container == "" and blocks.names == ["first", "second", "third"]
    assert blocks.override(AttributeModel()) == ["first", "second", "third"]


def test_a_block_whose_forward_the_model_bypasses_is_entered_through_what_it_calls():
    blocks = _trace(BypassModel())
    assert blocks.names == ["layers.0", "layers.1"]
    assert blocks.bypassed()["layers.0"] == ["layers.0.norm", "layers.0.mix"]
    assert "layers.0" not in blocks.called and "layers.0.mix" in blocks.called


@functools.lru_cache(maxsize=1)
def _cached_scale(length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(length, device=device)


class Caching(Block):
    """Caches tensors where models do: an attribute set on first use, a dict, a module-level lru_cache by device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "table", None) is None:
            self.table = torch.full((x.shape[-1],), 2.0, device=x.device)
            self.cache = {"scale": _cached_scale(x.shape[-1], x.device)}
        return x * self.table * self.cache["scale"]


def test_a_traced_forward_leaves_the_model_as_it_was():
    model = DictModel(layers=2)
    model.layers["0"] = Caching()
    ids = torch.randint(0, 16, (2, 5))
    assert _trace(model).names == ["layers.0", "layers.1"]
    assert "table" not in vars(model.layers["0"]) and "cache" not in vars(model.layers["0"])
    out = model(ids)  # the real run computes its own caches, on its own device, with real values
    assert not out.is_meta and torch.equal(model.layers["0"].table, torch.full((DIM,), 2.0))


def test_a_module_called_from_every_block_keeps_its_own_parameters_after_the_trace():
    model = DictModel(layers=3)
    for key in ("1", "2"):
        model.layers[key].mix = model.layers["0"].mix  # one module under three names (Zamba's shared attention)
    before = {name: (id(t), t.device) for name, t in model.named_parameters(remove_duplicate=False)}
    assert _trace(model).names == ["layers.0", "layers.1", "layers.2"]
    after = {name: (id(t), t.device) for name, t in model.named_parameters(remove_duplicate=False)}
    assert after == before and len(before) == 15  # 2 + 2 + 3 x (2 norm + 1 mix name x 2)


@pytest.mark.parametrize("model", [DictModel, SlotModel])
def test_the_container_search_finds_the_same_blocks_without_a_forward(model):
    traced = _trace(model())
    name, found = find_blocks(model())
    assert name == traced.container and len(found) == len(traced.names)


class NormedEmbeddingModel(DictModel):
    """Bloom's and ModernBERT's layout: a LayerNorm after the embedding, before the blocks, and one after them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_norm, self.final_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.embed(ids))
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.final_norm(x))


def test_modules_called_before_the_blocks_are_read_off_the_forward():
    """What runs before the first block (the pipeline's first stage keeps it) is read from the call order, whatever
    its type: the embedding's norm is before, the final norm (a LayerNorm too) and the head after."""
    from lightning_llm.parallel.pipeline.stand_ins import outer_modules

    model = NormedEmbeddingModel()
    traced = _trace(model)
    assert {"embed", "embed_norm"} <= traced.before and not traced.before & {"final_norm", "head", "layers.0.norm"}
    before, after = outer_modules(model, "layers", traced.before)
    assert (sorted(before), sorted(after)) == (["embed", "embed_norm"], ["final_norm", "head"])
    assert outer_modules(model, "layers") == (["embed"], ["head", "embed_norm", "final_norm"])  # by type alone


class CutBlock(nn.Module):
    """A gated MLP with its input and gate in one linear (ModernBERT's ``Wi``), cut after an element-wise op, and an
    attention-like projection viewed into heads (not a cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.Wi, self.Wo, self.q = nn.Linear(DIM, 12), nn.Linear(4, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.q(x).view(*x.shape[:-1], 2, DIM // 2).flatten(-2)
        up, gate, extra = torch.clamp(self.Wi(x), -10, 10).split([4, 4, 4], dim=-1)
        return x + self.Wo(up * torch.sigmoid(gate) + extra)


def test_the_parts_a_forward_cuts_a_linears_output_into_are_read_off_the_forward():
    """The widths recorded for ``Wi`` are the widths torch's own ``split`` gives on a real tensor of its output; the
    projection viewed into heads and the closing projection are not cut."""
    model = DictModel()
    for key in model.layers:
        model.layers[key] = CutBlock()
    traced = _trace(model)
    real = model.layers["0"].Wi(torch.zeros(1, DIM)).split([4, 4, 4], dim=-1)
    expected = tuple(part.shape[-1] for part in real)
    assert traced.cuts == {f"layers.{key}.Wi": expected for key in ("0", "1", "2")}


class ParallelBlock(nn.Module):
    """PaLM's layout: one projection cut into q (viewed into 2 heads of 4), a key and a value one head wide shared by
    every query head (multi-query; the key's rotary halves cut inside it), and the SwiGLU input, cut again in two."""

    def __init__(self) -> None:
        super().__init__()
        self.fused, self.out = nn.Linear(DIM, 8 + 4 + 4 + 12), nn.Linear(8 + 6, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v, ff = self.fused(x).split((8, 4, 4, 12), dim=-1)
        q = q.view(*q.shape[:-1], 2, 4).transpose(-3, -2)
        half, other = k.chunk(2, dim=-1)
        k = torch.cat((-other, half), dim=-1)
        attended = torch.softmax(q @ k.unsqueeze(-3).transpose(-1, -2), dim=-1) @ v.unsqueeze(-3)
        up, gate = ff.chunk(2, dim=-1)
        return x + self.out(torch.cat((attended.transpose(-3, -2).flatten(-2), up * gate), dim=-1))


def test_a_part_one_head_wide_is_shared_and_a_part_cut_again_gives_its_parts():
    """The query part is viewed into heads of 4; the key and value parts, 4 wide and never viewed into heads, are one
    head every rank uses whole ("*4"); the SwiGLU part is recorded as the two halves the forward cuts it into."""
    model = DictModel()
    for key in model.layers:
        model.layers[key] = ParallelBlock()
    traced = _trace(model)
    assert traced.cuts == {f"layers.{key}.fused": (8, "*4", "*4", 6, 6) for key in ("0", "1", "2")}
    assert traced.order.index("layers.0.fused") < traced.order.index("layers.0.out") < traced.order.index("layers.1")
