"""Lightning's own ModelParallelStrategy tests, with ``LLMParallelStrategy`` swapped in, on CPU ranks.

The test files here are Lightning 2.6.5's (``tests/tests_pytorch/strategies/``), copied unchanged except for
lines ending in ``# lightning_llm: ...``: the import of the strategy (the swap), the ``RunIf`` import, and
``"cuda"`` read as ``"cpu"``. A test marked ``RunIf(min_cuda_gpus=N)`` runs on N gloo ranks with one thread each;
``tmp_path`` is shared by the ranks, as one machine's disk is under ``torchrun``. Differences from
Lightning's behaviour that remain are listed in docs/strategy.md ("Lightning's own tests").
"""

from __future__ import annotations

import pytest

from lightning_llm.testing import run_distributed
from lightning_llm.testing.distributed import DistributedTestError
from tests.lightning_compat.runif import call_test

pytestmark = pytest.mark.distributed


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lightning_ranks(n): run the test function on n CPU ranks")
    config.addinivalue_line("markers", "lightning_condition: a RunIf condition that holds on every CI machine")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("lightning_ranks") is not None:
            item.add_marker(pytest.mark.distributed)


# Tests whose Trainer uses fewer devices than their RunIf asks the machine for (Lightning launches one process per
# Trainer device, so that many ranks run here).
DEVICES = {"test_model_parallel_single_file_checkpoint_with_compile": 1}


# Where LLMParallelStrategy differs from ModelParallelStrategy by design (docs/strategy.md, "Lightning's own tests"): the error each test
# must stop at. Any other failure fails the test, and so does a pass (the difference and its docs are then stale).
DIFFERENCES = {
    "test_model_parallel_integration.py::test_setup_device_mesh": (
        'assert device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")',
        "the mesh is 5-D (pp, dp_replicate, dp_shard, cp, tp) and answers to Lightning's axis names as aliases",
    ),
    "test_fsdp_trainer.py::test_configure_model": (
        "assert self.layer.weight.device == expected_device",
        "layers built in configure_model are on the meta device until setup shards and initializes them, each rank "
        "only its shards (FSDPStrategy builds them whole on the CPU first)",
    ),
    **dict.fromkeys(
        (
            "test_model_parallel_integration.py::test_tensor_parallel",
            "test_model_parallel_integration.py::test_modules_without_parameters",
        ),
        (
            "pass tensor_parallel_size='auto' for Lightning's layout",
            "the default layout is all data-parallel (Lightning's: all tensor-parallel); a configure_model that "
            "applies only TP is refused instead of leaving the data-parallel replicas unsynchronized",
        ),
    ),
}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("lightning_ranks")
    if marker is None:
        return None
    name = pyfuncitem.originalname
    key = f"{pyfuncitem.path.name}::{name}"
    kwargs = {arg: pyfuncitem.funcargs[arg] for arg in pyfuncitem._fixtureinfo.argnames}
    try:
        run_distributed(
            call_test, DEVICES.get(name, marker.args[0]), pyfuncitem.module.__name__, name, kwargs, timeout=240
        )
    except DistributedTestError as error:
        if key in DIFFERENCES and DIFFERENCES[key][0] in str(error):
            pytest.xfail(f"documented difference: {DIFFERENCES[key][1]}")
        raise
    if key in DIFFERENCES:
        pytest.fail(f"{key} now passes: remove it from DIFFERENCES here and from docs/strategy.md")
    return True
