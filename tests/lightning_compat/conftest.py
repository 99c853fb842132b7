"""Lightning's own ModelParallelStrategy tests, with ``LLMParallelStrategy`` swapped in, on CPU ranks.

The test files here are Lightning 2.6.5's (``tests/tests_pytorch/strategies/``), copied unchanged except for
lines ending in ``# lightning_llm: ...``: the import of the strategy (the swap), the ``RunIf`` import, and
``"cuda"`` read as ``"cpu"`` (``test_fsdp_trainer.py`` also translates FSDPStrategy's arguments; its header says
how). Tests where LLMParallelStrategy differs by design are listed in :data:`DIFFERENCES` with the error each must
stop at; they xfail only there. A test marked ``RunIf(min_cuda_gpus=N)`` runs on N gloo ranks with one thread each;
``tmp_path`` is shared by the ranks, as one machine's disk is under ``torchrun``. Differences from
Lightning's behaviour that remain are listed in docs/strategy.md ("Lightning's own tests").
"""

from __future__ import annotations

import pytest

from lightning_llm.testing import run_distributed
from tests.lightning_compat.runif import call_test


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


# One-process tests that set up a process group: each runs alone in a fresh rank, as Lightning's standalone runner
# does, so a group an earlier test left in this process cannot change what it sees.
ISOLATED = {"test_model_parallel.py::test_set_timeout"}

# Where LLMParallelStrategy differs from ModelParallelStrategy by design (docs/strategy.md, "Lightning's own tests"): the error each test
# must stop at. Any other failure fails the test, and so does a pass (the difference and its docs are then stale).
DIFFERENCES = {
    "test_model_parallel_integration.py::test_setup_device_mesh": (
        'assert device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")',
        "the mesh is 5-D (pp, dp_replicate, dp_shard, cp, tp) and answers to Lightning's axis names as aliases",
    ),
    "test_model_parallel.py::test_torch_greater_equal_2_4": (
        "LLMParallelStrategy requires PyTorch 2.4 or higher",
        "messages name the strategy's own class",
    ),
    "test_model_parallel.py::test_save_checkpoint_storage_options": (
        "`LLMParallelStrategy.save_checkpoint(..., storage_options=...)` is not supported",
        "messages name the strategy's own class",
    ),
    "test_model_parallel.py::test_validate_device_mesh_dimensions": (
        "make the product equal devices * nodes",
        "sizes that do not multiply to the world size raise ValueError naming each size and the fix (Lightning: "
        "RuntimeError)",
    ),
    "test_model_parallel.py::test_configure_model_required": (
        "object has no attribute 'tp'",
        "configure_model is optional (the strategy plans and applies the layout itself, also to a model built in "
        "__init__), so setup goes on to parallelize, which the test's mocks (no setup_environment) cannot",
    ),
    "test_model_parallel.py::test_meta_device_materialization": (
        "object has no attribute 'cp'",
        "the test calls setup() without setup_environment (a Mock mesh); LLMParallelStrategy plans the layout from "
        "what setup_environment builds (meta initialization: tests/parallel/test_materialize.py)",
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
    name = pyfuncitem.originalname
    key = f"{pyfuncitem.path.name}::{name}"
    if marker is None and key not in DIFFERENCES and key not in ISOLATED:
        return None  # a one-process test that holds as Lightning wrote it: pytest runs it
    kwargs = {arg: pyfuncitem.funcargs[arg] for arg in pyfuncitem._fixtureinfo.argnames}
    try:
        if marker is None and key not in ISOLATED:
            pyfuncitem.obj(**kwargs)
        else:
            ranks = DEVICES.get(name, marker.args[0] if marker else 1)
            run_distributed(call_test, ranks, pyfuncitem.module.__name__, name, kwargs, timeout=240)
    except (Exception, pytest.fail.Exception) as error:
        seen = f"{error} {error.__context__} {error.__cause__}"  # pytest.warns reports its block's error as context
        if key in DIFFERENCES and DIFFERENCES[key][0] in seen:
            pytest.xfail(f"documented difference: {DIFFERENCES[key][1]}")
        raise
    if key in DIFFERENCES:
        pytest.fail(f"{key} now passes: remove it from DIFFERENCES here and from docs/strategy.md")
    return True
