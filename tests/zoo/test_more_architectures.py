"""More Hugging Face architectures under tp2, tp2+SP, pp2, ZeRO-3 and selective AC against one process, no plan given.

MoE layouts (OLMoE, Granite-MoE, GLM-4.5-MoE with a dense first layer, ERNIE-4.5-MoE), dense variants (parallel
residual: Phi, Cohere; partial rotary: StableLM, Phi; biases: Starcoder2; no rope on some layers: SmolLM3) and
Qwen3-Next (gated delta-net linear attention beside full attention, MoE with a shared expert and a scalar gate),
then models held out in a later round: HunYuan-MoE (a router inside a gate module), Bamba and Falcon-H1 (Mamba-2
mixers, kept whole under TP), Llama 4 (every expert on every token) and MPT (a fused [q | k | v] read off the
forward). Each cell: per-step loss and every parameter within 1e-5 relative of one process (fp32), every
parameter identical on the ranks holding it, and under tp each rank holding at most 55% of the attention and of
the expert parameters (measured from the local shards).
"""

from __future__ import annotations

import pytest

from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity
from tests.zoo._harness import LAYOUTS as ZOO_LAYOUTS
from tests.zoo._harness import train, train_zoo
from tests.zoo._models_more import HELD_OUT, MORE_MODELS, register

LAYOUTS = ["tp2", "tp2_sp", "pp2", "dp2_zero3", "ac_selective"]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
assert all(layout in ZOO_LAYOUTS for layout in LAYOUTS)
_runs: dict = {}
_references: dict = {}


def _train_more(layouts: list[str], models: list[str]) -> dict:
    register()  # in the spawned ranks
    return train_zoo(layouts, models)


@pytest.mark.parametrize("name", MORE_MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_more_architectures_under_tensor_parallel_match_single_process(layout, name):
    if not _runs:
        _runs.update(run_distributed(_train_more, 2, LAYOUTS, MORE_MODELS, timeout=840)[0])
    _assert_cell(_runs[layout][name], layout, name)


def _assert_cell(result, layout: str, name: str) -> None:
    """One cell against one process: parity, replicas agreeing, and under tp each rank's share."""
    assert not isinstance(result, str), f"{name} under {layout} failed:\n{result}"
    losses, params, differing, _, held = result
    if name not in _references:
        register()
        _references[name] = train(name)
    ref_losses, ref_params, *_ = _references[name]
    assert not differing, f"{name} {layout}: parameters differ between ranks holding them: {differing}"
    assert_parity((losses, params), (ref_losses, ref_params), f"{name} {layout}", rtol=1e-5, loss_rtol=1e-5)
    if layout.startswith("tp"):
        assert held and all(share <= 0.55 for share in held.values()), f"{name} {layout}: a rank holds {held}"


HELD_OUT_LAYOUTS = ["tp2", "tp2_sp", "pp2"]
_held_out_runs: dict = {}


@pytest.mark.parametrize("name", list(HELD_OUT))
@pytest.mark.parametrize("layout", HELD_OUT_LAYOUTS)
def test_held_out_architectures_under_the_layouts_they_needed_match_single_process(layout, name):
    """Architectures a sweep found failing, as a new user brings them. ModernBERT's decoder: tp2 was refused in the
    first forward (its `Wi` split column-wise, then cut in two by the model), tp2 + SP too, and then crashed (its
    prediction head, a linear and a norm between the final norm and the vocabulary projection, met the
    sequence-sharded stream with plain weights), and pp2 was refused (its embedding LayerNorm taken for a module after
    the blocks). Granite-MoE-Hybrid: tp2 and tp2 + SP stopped in the first forward (its Hugging Face plan splits the
    shared MLP's ``input_linear`` column-wise, which the model ``chunk``s into gate and up). OPT: tp2 and tp2 + SP
    crashed in the first forward (its learned positions, an ``nn.Embedding`` subclass called with the attention mask,
    looked up plain indices in a split table), and pp2 crashed on the later stage (the embedding's stand-in took
    one argument) while the other rank waited for it."""
    if not _held_out_runs:
        _held_out_runs.update(run_distributed(_train_more, 2, HELD_OUT_LAYOUTS, list(HELD_OUT), timeout=600)[0])
    _assert_cell(_held_out_runs[layout][name], layout, name)
