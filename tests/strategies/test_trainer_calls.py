"""Every Trainer entry point on one model: fit then test / validate on the same Trainer, then test on a new one.

FSDP2 and tensor parallelism can be applied to a module once; the second ``setup`` must reuse what the first
applied (``lightning_llm/strategies/applied_layouts.py``). The oracle is one process: the trained weights,
gathered whole, loaded into a fresh model and evaluated on the same samples by a plain single-device Trainer.
A different layout on the already-parallelized model is refused, naming both.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from tests.strategies._parity import data, full_state, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {
    "dp2_zero3": {"zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "num_microbatches": 2},
}
BATCHES, PER_RANK = 2, 4


def _trainer(strategy=None, devices: int = 2) -> L.Trainer:
    return cpu_trainer(
        devices=devices,
        strategy=strategy or "auto",
        max_steps=2,
        limit_val_batches=BATCHES,
        limit_test_batches=BATCHES,
        num_sanity_val_steps=0,
    )


def _calls(layouts: list[str]) -> dict:
    import torch.distributed as dist

    results = {}
    for layout in layouts:
        module = make_model("reference")
        trainer = _trainer(LLMParallelStrategy(**LAYOUTS[layout]))
        trainer.fit(module, data(PER_RANK))
        calls = {
            "test": trainer.test(module, data(PER_RANK), verbose=False)[0]["test_loss"],
            "validate": trainer.validate(module, data(PER_RANK), verbose=False)[0]["val_loss"],
            "new_trainer_test": _trainer(LLMParallelStrategy(**LAYOUTS[layout])).test(
                module, data(PER_RANK), verbose=False
            )[0]["test_loss"],
        }
        try:
            _trainer(LLMParallelStrategy(tensor_parallel_size=2, sequence_parallel=True)).test(module, data(PER_RANK))
            calls["other_layout"] = None
        except ValueError as error:
            calls["other_layout"] = str(error)
        dp = dist.get_world_size() if layout.startswith("dp") else 1
        results[layout] = (calls, full_state(module), dp)
    return results if dist.get_rank() == 0 else None


def _single_process(state: dict, dp: int) -> tuple[float, float]:
    """(test loss, validation loss) of the weights in one process, over the samples all data-parallel ranks saw."""
    module = make_model("reference")
    module.load_state_dict(state)
    trainer = _trainer(devices=1)
    datamodule = data(PER_RANK * dp)
    test = trainer.test(module, datamodule, verbose=False)[0]["test_loss"]
    return test, trainer.validate(module, datamodule, verbose=False)[0]["val_loss"]


_runs: dict = {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fit_then_test_validate_and_a_new_trainer_reuse_the_layout(layout):
    if not _runs:
        _runs.update(run_distributed(_calls, 2, list(LAYOUTS), timeout=540)[0])
    calls, state, dp = _runs[layout]
    test, validate = _single_process(state, dp)
    assert calls["test"] == pytest.approx(test, rel=1e-5), (calls, test)
    assert calls["new_trainer_test"] == pytest.approx(test, rel=1e-5), (calls, test)
    assert calls["validate"] == pytest.approx(validate, rel=1e-5), (calls, validate)
    assert calls["other_layout"] is not None and "already parallelized" in calls["other_layout"], calls
    assert torch.isfinite(torch.tensor(test))


PREDICT_TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(5))


def _predict_loader():
    return torch.utils.data.DataLoader(PREDICT_TOKENS, batch_size=2)


def _more_calls(layouts: list[str]) -> dict:
    """validate -> fit, fit twice and predict on one model, each against the same layout's plain fit."""
    import torch.distributed as dist

    results = {}
    for layout in layouts:
        strategy = lambda: LLMParallelStrategy(**LAYOUTS[layout])  # noqa: E731
        fresh = make_model("reference")
        _trainer(strategy()).fit(fresh, data(PER_RANK))
        validated = make_model("reference")
        trainer = _trainer(strategy())
        trainer.validate(validated, data(PER_RANK), verbose=False)
        trainer.fit(validated, data(PER_RANK))
        twice = make_model("reference")
        _trainer(strategy()).fit(twice, data(PER_RANK))
        _trainer(strategy()).fit(twice, data(PER_RANK))  # two more steps from where the first fit ended
        predicted = _trainer(strategy()).predict(fresh, _predict_loader())
        results[layout] = {
            "fresh": full_state(fresh),
            "validate_then_fit": full_state(validated),
            "fit_twice": full_state(twice),
            "predicted": torch.cat([p.detach().full_tensor() if hasattr(p, "full_tensor") else p for p in predicted]),
        }
    return results if dist.get_rank() == 0 else None


def _fit_twice_in_one_process(state: dict) -> dict:
    """The oracle of fit twice: the first fit's weights loaded into a fresh model, which a new Trainer fits again."""
    module = make_model("reference")
    module.load_state_dict(state)
    _trainer(devices=1).fit(module, data(PER_RANK))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("layout", ["tp2"])
def test_validate_then_fit_fit_twice_and_predict_on_one_model(layout):
    # tp2: both ranks see the same batches, so one process is the oracle for every call.
    results = run_distributed(_more_calls, 2, [layout], timeout=540)[0][layout]
    for name, tensor in results["fresh"].items():
        assert torch.allclose(results["validate_then_fit"][name], tensor, rtol=1e-5, atol=1e-6), name
    for name, tensor in _fit_twice_in_one_process(results["fresh"]).items():
        assert torch.allclose(results["fit_twice"][name], tensor.float(), rtol=1e-5, atol=1e-6), name
    module = make_model("reference")
    module.load_state_dict(results["fresh"])
    with torch.no_grad():
        expected = torch.cat([module(batch) for batch in _predict_loader()])
    torch.testing.assert_close(results["predicted"], expected, rtol=1e-5, atol=1e-5)
