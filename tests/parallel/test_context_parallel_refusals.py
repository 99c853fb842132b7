"""Context parallelism refuses, by name and before training, what it cannot do exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.parallel.cp import CPGroup
from lightning_llm.parallel.cp.apply import check_context_parallel
from lightning_llm.parallel.cp.sharding import shard_model_io
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.strategies import LLMParallelStrategy
from tests.zoo._models import ZooLM

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"context_parallel_size": 0}, "context_parallel_size"),
        ({"context_parallel_size": 2, "context_parallel_method": "rings"}, "context_parallel_method"),
        ({"context_parallel_size": 2, "compile_blocks": True}, "compile_blocks=True"),
    ],
)
def test_bad_context_parallel_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMParallelStrategy(**kwargs)


def test_options_are_forwarded_and_the_preset_is_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = LLMParallelStrategy(context_parallel_size=2)
    assert strategy.context_parallel_size == 2 and strategy.context_parallel_method == "ring"
    assert StrategyRegistry.get("llm_cp2").context_parallel_size == 2


def test_mesh_degrees_include_cp():
    dims = ParallelDims.for_world(8, tp=2, cp=2)
    assert (dims.dp_shard, dims.cp, dims.dp) == (2, 2, 2)  # CP ranks are not data-parallel replicas
    assert ParallelDims.for_world(4, cp=2, replicate_all=True).dp_replicate == 2
    with pytest.raises(ValueError, match=r"not divisible by tp \(1\) \* cp \(4\)"):
        ParallelDims(world_size=6, cp=4)
    with pytest.raises(ValueError, match=r"context_parallel_size \(2\) = 8, but there are 4 processes"):
        ParallelDims.for_world(4, dp=4, cp=2)


@pytest.mark.parametrize(
    "name, feature",
    [
        ("gemma2", r"attention logit softcapping"),
        ("litgpt_llama", r"takes no `position_ids`"),
    ],
)
def test_models_cp_cannot_split_exactly_are_refused_by_feature(name, feature):
    """At setup; a forward without ``position_ids`` only under pipeline parallelism (else at its first forward)."""
    module = ZooLM(name)
    blocks_name = "model.transformer.h" if name.startswith("litgpt") else "model.model.layers"
    blocks = list(module.get_submodule(blocks_name))
    with pytest.raises(ValueError, match=feature):
        check_context_parallel(module, blocks_name=blocks_name, blocks=blocks, pipelined=name.startswith("litgpt"))


def test_ulysses_refuses_heads_that_do_not_divide():
    from lightning_llm.parallel.cp.ulysses import check_ulysses_heads

    check_ulysses_heads(8, 2, 2, tp=2)
    with pytest.raises(ValueError, match=r"= 4 ranks whole attention heads, but the model has 6 query heads; use "):
        check_ulysses_heads(6, 2, 2, tp=2)


def test_sequence_length_not_divisible_is_refused_at_the_first_batch():
    model = torch.nn.Linear(1, 1)
    model.forward = lambda input_ids, position_ids=None: input_ids  # a stand-in: only the hooks run here
    shard_model_io(model, CPGroup(None, 2, 0))
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4; make the model's input length"):
        model(torch.zeros(2, 10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"does not shard a padding mask"):
        model(torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.tensor([[1] * 8, [0] + [1] * 7]))


def test_alibi_is_refused_by_name():
    import transformers

    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    holder = torch.nn.Module()
    holder.model = transformers.BloomForCausalLM(config)
    with pytest.raises(ValueError, match=r"ALiBi / position-bias argument 'alibi' in block 0"):
        check_context_parallel(holder, blocks_name="model.transformer.h", blocks=list(holder.model.transformer.h))


class _EagerBlock(torch.nn.Module):
    """Attention computed by hand (softmax of q k^T): nothing CP can intercept."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def test_a_block_whose_attention_bypasses_cp_is_refused_at_its_first_forward():
    from lightning_llm.parallel.cp.interception import route_attention

    blocks = torch.nn.ModuleList([_EagerBlock()])
    route_attention(torch.nn.Sequential(*blocks), list(blocks), CPGroup(None, 1, 0), blocks_name="layers")
    with pytest.raises(RuntimeError, match=r"block layers.0 computed no attention through context parallelism") as e:
        blocks[0](torch.randn(1, 4, 8))
    assert "trace" not in str(e.value)
    # Without the trace (a forward that does not run on fake tensors, or none passed) the refusal says what is missing.
    blocks = torch.nn.ModuleList([_EagerBlock()])
    route_attention(torch.nn.Sequential(*blocks), list(blocks), CPGroup(None, 1, 0), blocks_name="layers", traced=False)
    with pytest.raises(RuntimeError, match=r"No trace of the forward was given.*traced="):
        blocks[0](torch.randn(1, 4, 8))


def test_a_sliding_window_cp_cannot_see_is_refused():
    """Hugging Face layers hand their window to the CP attention (trained to parity in
    tests/strategies/test_context_parallel_parity.py); elsewhere a window is refused at setup, and an HF layer with
    a window that does not pass it is refused at its first call."""
    from types import SimpleNamespace

    from lightning_llm.parallel.cp import interception

    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.config = SimpleNamespace(sliding_window=8, num_attention_heads=4)
    holder.model.layers = torch.nn.ModuleList([_EagerBlock()])
    holder.model.forward = lambda input_ids, position_ids=None: input_ids
    with pytest.raises(
        ValueError, match=r"sliding-window attention outside transformers' attention registry \(window 8\)"
    ):
        check_context_parallel(holder, blocks_name="model.layers", blocks=list(holder.model.layers))
    check_context_parallel(
        ZooLM("mistral"), blocks_name="model.model.layers", blocks=list(ZooLM("mistral").model.model.layers)
    )

    layer = torch.nn.Module()
    layer.sliding_window = 4
    q = torch.randn(1, 2, 8, 4)
    refusal = pytest.raises(ValueError, match=r"Module has sliding_window=4 but did not pass it to its attention")
    with interception.block_call(CPGroup(None, 1, 0)), refusal:
        interception._hf_attention(layer, q, q, q, None)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.forward_parallel(x)

    def forward_parallel(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attention.transpose(1, 2).flatten(-2))


class _Stack(torch.nn.Module):
    """Blocks called as modules, or through another of their methods (as yet-another-retnet's stack does)."""

    def __init__(self, as_modules: bool) -> None:
        super().__init__()
        self.embed, self.head, self.as_modules = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32), as_modules
        self.layers = torch.nn.ModuleList(_Attention() for _ in range(2))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x) if self.as_modules else x + layer.forward_parallel(x)
        return self.head(x)


@pytest.mark.parametrize("as_modules", [True, False])
def test_blocks_the_forward_does_not_call_as_modules_are_refused(as_modules):
    """The blocks found from the traced forward must each be entered as a module (their hooks route attention);
    the same model calling them as modules passes."""
    from lightning_llm.modeling.structure import traced_blocks
    from lightning_llm.parallel.cp import refuse_blocks_not_called

    holder = torch.nn.Module()
    holder.model = _Stack(as_modules)
    traced = traced_blocks(holder, lambda move: holder.model(move(torch.randint(0, 32, (2, 8)))))
    assert traced.names == ["model.layers.0", "model.layers.1"]
    if as_modules:
        refuse_blocks_not_called("model.layers", holder.model.layers, traced.called)
        return
    with pytest.raises(ValueError, match=r"does not call model\.layers\.0 \(2 of 2 blocks\) as a module"):
        refuse_blocks_not_called("model.layers", holder.model.layers, traced.called)


class _Positions(torch.nn.Module):
    """Positions read every way the package makes global: a learned table looked up with ``torch.arange(T)`` or
    with ``0..T-1`` counted by ``cumsum``, a rotary-like ``arange`` of its own, a ``[:T]`` slice and a ``narrow`` of
    a cached table built for the longest sequence (litgpt's ``cos[:T]``)."""

    def __init__(self, table: bool = True, cumsum: bool = False, extra_arange: bool = False, cache: str = "") -> None:
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(32, 4), torch.nn.Embedding(16, 4) if table else None
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.extra, self.cumsum, self.cache = extra_arange, cumsum, cache
        self.register_buffer("cos", torch.cos(torch.arange(16.0)[:, None] / torch.arange(1.0, 5.0)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        x = self.embed(input_ids)
        if self.pos is not None:
            ids = torch.ones(length, dtype=torch.long).cumsum(0) - 1 if self.cumsum else torch.arange(length)
            x = x + self.pos(ids)
        if self.extra:
            x = x * torch.cos(torch.arange(length)[:, None].float())
        if self.cache == "slice":
            x = x * self.cos[:length]
        if self.cache == "narrow":
            x = x * self.cos.narrow(0, 0, length)
        return self.layers[0](x)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"cumsum": True},
        {"extra_arange": True},
        {"cumsum": True, "extra_arange": True},
        {"table": False, "cache": "slice"},
        {"table": False, "cache": "narrow"},
        {"table": False},
    ],
)
def test_positions_read_inside_the_forward_are_global_and_a_model_reading_none_is_refused(kwargs):
    """Rank 1 of C=2 holds positions (2, 3, 4, 5) of 8 (zig-zag); set as the input-sharding hook sets them. Oracle:
    the same position-wise model on all 8 tokens in one process, at those rows; every later forward too. A model
    that read no positions is refused at its first forward."""
    from lightning_llm.parallel.cp.positions import PositionReads, global_position_tables

    model = _Positions(**kwargs)
    tokens = torch.randint(0, 32, (2, 8))
    want = model(tokens)[:, 2:6]
    reads = PositionReads(length=4, positions=torch.tensor([2, 3, 4, 5]))
    global_position_tables(model, list(model.layers), reads, where="model")
    if kwargs == {"table": False}:
        with pytest.raises(ValueError, match=r"takes no `position_ids`, .* its first forward read no positions"):
            model(tokens[:, 2:6])
        return
    for _ in range(2):
        torch.testing.assert_close(model(tokens[:, 2:6]), want, rtol=0, atol=0)


def test_multihead_attention_asked_for_its_weights_is_refused():
    """nn.MultiheadAttention's default need_weights=True cannot be honoured by the CP attention: refused, not ignored."""
    from lightning_llm.parallel.cp.multihead import multi_head_attention

    attention = torch.nn.MultiheadAttention(8, 2)
    x = torch.randn(4, 1, 8)
    args = (x, x, x, 8, 2, attention.in_proj_weight, attention.in_proj_bias, None, None, False, 0.0)
    args += (attention.out_proj.weight, attention.out_proj.bias)
    with pytest.raises(ValueError, match=r"called with need_weights=True \(attention weights cannot be returned\)"):
        multi_head_attention(args, {"need_weights": True}, "block 0", lambda *a, **k: None)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out, weights = multi_head_attention(args, {"need_weights": False}, "block 0", sdpa)
    want, _ = attention(x, x, x, need_weights=False)
    torch.testing.assert_close(out, want)
    assert weights is None
