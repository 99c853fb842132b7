"""``compile_blocks=True`` trains exactly like eager: tiny preset, 2 blocks, fp32, one process.

Inductor on CPU generates C++ (needs gcc) and fuses pointwise ops, which may reorder float
additions: per-step losses must agree within 1e-5 relative over 3 steps, parameters within 1e-5.
Compilation costs tens of seconds, so the test has its own marker, ``compile``; CI runs it
(``pytest -m compile`` selects it alone, ``-m "not compile"`` leaves it out).
"""

import pytest

from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, make_model, train

pytestmark = [pytest.mark.compile, pytest.mark.timeout(600)]


def _eager_and_compiled():
    from torch._dynamo.utils import counters

    eager = train("reference", LLMParallelStrategy(), steps=3)
    model = make_model("reference")
    compiled = train("reference", LLMParallelStrategy(compile_blocks=True), steps=3, model=model)
    compiled_blocks = [block._compiled_call_impl is not None for block in model.model.layers]
    return eager, compiled, compiled_blocks, counters["stats"]["unique_graphs"]


def test_compiled_blocks_match_eager():
    ((eager, compiled, compiled_blocks, graphs),) = run_distributed(_eager_and_compiled, 1, timeout=540)
    assert compiled_blocks == [True, True]
    assert graphs >= 1, "dynamo traced no graph: the blocks ran eagerly"
    assert_parity(compiled, eager, "compile_blocks=True vs eager")
