"""fp8 conversion: exactly the blocks' 16-aligned Linear layers become torchao Float8Linear, nothing else
(under tensor parallelism: only those the plan splits by column or row).

The oracle is a brute-force list over ``named_modules()`` (every ``nn.Linear``, kept when it sits in
the blocks, both dims divide by 16 and no exclude pattern matches) against what torchao actually
swapped (``isinstance(m, Float8Linear)`` after conversion).
"""

import fnmatch

import pytest
import torch
from torch import nn

from lightning_llm.parallel.float8 import apply_fp8, validate_fp8
from lightning_llm.parallel.tp.styles import OwnLocalOutput
from lightning_llm.strategies import LLMParallelStrategy
from tests._optional import TORCHAO_REASON
from tests.strategies._parity import make_model

# The fp8 extra (torchao) is part of the dev install; without it these tests skip (tests/test_optional_dependencies.py
# checks the refusal).
Float8Linear = pytest.importorskip("torchao.float8.float8_linear", reason=TORCHAO_REASON).Float8Linear


class _OddBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd_out = nn.Linear(64, 24)  # 24 % 16 != 0
        self.odd_in = nn.Linear(24, 32)  # 24 % 16 != 0
        self.gate = nn.Linear(32, 32)

    def forward(self, x):
        return x + self.gate(self.odd_in(self.odd_out(self.up(x))))


class OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(_OddBlock() for _ in range(3))
        self.proj_in_head = nn.Linear(32, 32)  # 16-aligned but outside the blocks
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.proj_in_head(x))


def _brute_force(model: nn.Module, blocks_prefix: str, exclude=()) -> list[str]:
    wanted = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        out_dim, in_dim = m.weight.shape
        inside = name.split(".")[: len(blocks_prefix.split("."))] == blocks_prefix.split(".") and name != blocks_prefix
        if inside and in_dim % 16 == 0 and out_dim % 16 == 0 and not any(fnmatch.fnmatch(name, p) for p in exclude):
            wanted.append(name)
    return wanted


def _converted(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


CASES = [
    ("reference", "model.layers", ()),
    ("reference", "model.layers", ("*.feed_forward.down_proj", "model.layers.1.attention.*")),
    ("hf_llama", "model.model.layers", ()),
    ("user", "blocks", ("*.attn.proj",)),
    ("odd", "layers", ("layers.2.*",)),
]


@pytest.mark.parametrize("arch, blocks, exclude", CASES, ids=[f"{a}-{len(e)}excluded" for a, _, e in CASES])
def test_exactly_the_eligible_block_linears_are_converted(arch, blocks, exclude):
    model = OddModel() if arch == "odd" else make_model(arch)
    expected = _brute_force(model, blocks, exclude)
    linears_before = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    names = apply_fp8(model, blocks_name=blocks, exclude=exclude)
    assert _converted(model) == expected == names
    skipped = [n for n in linears_before if n not in expected]
    assert skipped, "every case keeps some Linear layer (at least the head) out of fp8"
    for name in skipped:
        assert type(model.get_submodule(name)) is nn.Linear, name


def test_head_and_odd_dims_are_the_ones_skipped():
    model = OddModel()
    apply_fp8(model, blocks_name="layers")
    assert {n for n, m in model.named_modules() if type(m) is nn.Linear} == {
        "lm_head",
        "proj_in_head",
        *(f"layers.{i}.{k}" for i in range(3) for k in ("odd_out", "odd_in")),
    }


def test_converted_model_trains_close_to_high_precision():
    torch.manual_seed(0)
    reference = OddModel()
    fp8 = OddModel()
    fp8.load_state_dict(reference.state_dict())
    apply_fp8(fp8, blocks_name="layers")
    tokens = torch.randint(0, 50, (4, 16))
    out, want = fp8(tokens), reference(tokens)
    # e4m3 keeps 3 mantissa bits: each cast rounds by <= 2^-4 relative; the outputs stay close, not equal.
    assert not torch.equal(out, want)
    assert (out - want).norm() / want.norm() < 0.1
    out.square().mean().backward()
    reference(tokens).square().mean().backward()
    for (name, p), q in zip(fp8.named_parameters(), reference.parameters()):
        assert p.grad is not None and (p.grad - q.grad).norm() <= 0.2 * q.grad.norm() + 1e-6, name


def test_nothing_to_convert_and_bad_recipes_are_refused():
    with pytest.raises(ValueError, match="fp8 found no Linear layer to convert under 'layers'"):
        apply_fp8(OddModel(), blocks_name="layers", exclude=["layers.*"])
    with pytest.raises(ValueError, match="fp8='e5m2' is not supported; use True, False or one of"):
        validate_fp8("e5m2")
    with pytest.raises(ValueError, match="cannot all-gather fp8 weights under FSDP2"):
        apply_fp8(OddModel(), blocks_name="layers", recipe="rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="fp8='rowwise' with tensor_parallel_size=2 is not supported: a rowwise scale"):
        LLMParallelStrategy(tensor_parallel_size=2, fp8="rowwise")
    assert LLMParallelStrategy(tensor_parallel_size=2, fp8=True).fp8 == "tensorwise"
    assert validate_fp8(True) == "tensorwise" and validate_fp8(False) is None


class _MixedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)  # fused: split by its own style
        self.o = nn.Linear(32, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.router = nn.Linear(32, 16)  # kept whole on every rank
        self.extra = nn.Linear(32, 32)  # not named by the plan


def test_under_tp_only_the_column_and_row_split_layers_train_in_fp8():
    from lightning_llm.parallel.tp.float8 import fp8_tp_exclusions

    model = nn.Module()
    model.layers = nn.ModuleList(_MixedBlock() for _ in range(2))
    model.head = nn.Linear(32, 64)
    plan = {
        "layers.*.qkv": "fused_qkv",
        "layers.*.o": "rowwise",
        "layers.*": "replicate",  # matches every module under layers but applies nothing, as in apply_tensor_parallel
        "layers.*.up": "colwise",
        "layers.*.down": "rowwise",
        "layers.*.router": "replicate",
        "head": "colwise_gather",
    }
    excluded = fp8_tp_exclusions(model, plan, "layers")
    assert excluded == [f"layers.{i}.{n}" for i in range(2) for n in ("qkv", "router", "extra")]
    names = apply_fp8(model, blocks_name="layers", exclude=excluded)
    assert names == _converted(model) == [f"layers.{i}.{n}" for i in range(2) for n in ("o", "up", "down")]


def test_fp8_layers_refuse_styles_and_recipes_the_tp_path_does_not_support():
    from lightning_llm.parallel.tp.float8 import Float8Split
    from lightning_llm.parallel.tp.styles import parallel_style

    model = OddModel()
    apply_fp8(model, blocks_name="layers")
    layer = model.layers[0].up
    assert isinstance(parallel_style("colwise", True, layer), Float8Split)
    assert isinstance(parallel_style("rowwise", False, layer), OwnLocalOutput)  # local output for the model's code
    assert parallel_style("replicate", False, layer) is None
    with pytest.raises(ValueError, match="style 'fused_qkv' cannot split an fp8 layer .Float8Linear."):
        parallel_style("fused_qkv", False, layer)
    rowwise = OddModel()
    apply_fp8(rowwise, blocks_name="layers", recipe="rowwise")
    with pytest.raises(ValueError, match="does not use the 'tensorwise' recipe; under tensor parallelism only"):
        parallel_style("colwise", False, rowwise.layers[0].up)


def test_rowwise_recipe_converts_the_same_layers():
    model = OddModel()
    names = apply_fp8(model, blocks_name="layers", recipe="rowwise")
    assert names == _converted(model) == _brute_force(OddModel(), "layers")


def test_missing_torchao_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes the import raise ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'lightning_llm\[fp8\]'"):
        apply_fp8(OddModel(), blocks_name="layers")


def test_lightning_refuses_an_fp8_precision_string():
    # Why fp8 is a strategy flag: Lightning validates `precision` itself and has no "fp8-mixed".
    import lightning as L

    with pytest.raises(ValueError, match="fp8-mixed"):
        L.Trainer(accelerator="cpu", precision="fp8-mixed", logger=False)


def test_an_exclude_pattern_that_matches_nothing_is_warned_about():
    model = make_model("reference")
    with pytest.warns(UserWarning, match=r"fp8_exclude patterns \['\*\.down_prj'\] match no module"):
        apply_fp8(model, blocks_name="model.layers", exclude=["*.down_prj", "*.feed_forward.down_proj"])
    assert "model.layers.0.feed_forward.down_proj" not in _converted(model)  # the pattern that matches still applies
