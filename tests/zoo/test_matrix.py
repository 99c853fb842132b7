"""docs/models.md's architectures table is the one the test matrix generates, and every tested model is classified."""

import pytest

from tests.zoo.matrix import BEGIN, DOC, END, MECHANISMS, cells, render

pytestmark = pytest.mark.timeout(120)


def test_the_documented_table_is_the_generated_one():
    document = DOC.read_text()
    assert BEGIN in document and END in document
    assert render(document) == document, "docs/models.md is stale: run `python -m tests.zoo.matrix --write`"


def test_every_tested_model_stands_for_a_mechanism_and_every_mechanism_is_tested():
    tested = cells()
    classified = {model for models in MECHANISMS.values() for model in models}
    assert set(tested) <= classified, f"tested models with no mechanism row: {sorted(set(tested) - classified)}"
    assert classified <= set(tested), f"mechanism rows naming untested models: {sorted(classified - set(tested))}"
