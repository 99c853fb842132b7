"""LLMParallelStrategy takes a global-norm-clipping twin of the precision plugin Lightning chose."""

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.strategies.precision import GlobalNormClipping, check_clipping


@pytest.mark.parametrize(
    "plugin", [Precision(), MixedPrecision("bf16-mixed", "cpu"), HalfPrecision("bf16-true")], ids=type
)
def test_lightnings_plugins_are_exchanged_for_their_global_norm_twin(plugin):
    strategy = LLMParallelStrategy()
    strategy.precision_plugin = plugin  # what Lightning's accelerator connector does
    ours = strategy.precision_plugin
    assert isinstance(ours, GlobalNormClipping) and isinstance(ours, type(plugin))
    assert ours.precision == plugin.precision
    # Clipping through the plugin reaches the strategy's global-norm clip.
    calls = []
    ours.clip_fn = lambda optimizer, value: calls.append(value)
    ours.clip_gradients(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), 0.5, "norm")
    assert calls == [0.5]


def test_a_custom_plugin_is_kept_and_norm_clipping_with_it_refused():
    class Custom(Precision):
        pass

    strategy = LLMParallelStrategy()
    strategy.precision_plugin = Custom()
    assert type(strategy.precision_plugin) is Custom
    with pytest.raises(ValueError, match="gradient_clip_val=1.0 clips by norm, but the precision plugin Custom"):
        check_clipping(strategy.precision_plugin, 1.0, None)
    check_clipping(strategy.precision_plugin, 1.0, "value")  # clipping by value is per element: fine
