"""Nothing the package sets on a user's module survives a training step: its own state lives on its own objects.

Each layout below puts one of the package's forward hooks on a user's module (experts split by tp, by expert rows,
by expert parallelism; per-head parameters lent for the attention's call; an MoE block gathering the sequence),
some under activation checkpointing (the recompute re-enters the hooks inside backward). Every module's attribute
names are recorded before :func:`~lightning_llm.parallel.parallelize.parallelize` and compared after one step: a
new private name is state the package left on the user's module. Names torch's own APIs put there (composable
checkpoint's state, ``distribute_module``'s mark) are allowed by name.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.testing import run_distributed

# layout -> (zoo model, experts implementation or None, parallelize arguments, activation checkpointing)
LAYOUTS = {
    "tp2_sp_experts": ("mixtral", "eager", {"sequence_parallel": True}, True),
    "tp2_expert_rows": ("llama4", "rows", {}, True),
    # GptOss's experts stay whole under tp (as in tests/zoo/_models_attention.py's plans); its sinks are per head.
    "tp2_attention_sinks": (
        "gpt_oss_sinks",
        None,
        {"tensor_parallel_plan": {"model.model.layers.*.mlp.experts": "replicate"}},
        False,
    ),
    "ep2": ("mixtral", "eager", {"expert_parallel_size": 2}, True),
}
# What torch itself keeps in a module's __dict__: distribute_module's mark, the composable APIs' (checkpoint's)
# state and registry under generated keys.
TORCH_OWNED = ("_distribute_module_applied",)
TORCH_OWNED_PREFIX = "__composable_api_state_key"


def _torch_owned(name: str) -> bool:
    return name in TORCH_OWNED or name.startswith(TORCH_OWNED_PREFIX)


def _build(name: str, implementation: str | None):
    """A zoo model; its experts (if given) run ``implementation``, as in tests/parallel/test_experts_parallel.py."""
    import tests.zoo._models_attention  # noqa: F401  (registers gpt_oss_sinks)
    from tests.zoo._models import ZooLM
    from tests.zoo._models_more import register

    register()
    module = ZooLM(name)
    for experts in (m for n, m in module.named_modules() if n.endswith(".experts") and hasattr(m, "config")):
        if implementation is not None:
            experts.config._experts_implementation = implementation
    return module


def _new_private_names(layouts: list[str]) -> dict | None:
    """On each rank: layout -> {module name: private attribute names added by setup and one training step}."""
    import torch.distributed as dist

    from lightning_llm.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_llm.parallel.kv_cache import disable_kv_cache
    from lightning_llm.parallel.mesh import ParallelDims
    from lightning_llm.parallel.parallelize import parallelize
    from tests.zoo._harness import tokens

    found = {}
    for layout in layouts:
        name, implementation, kwargs, checkpointed = LAYOUTS[layout]
        ep = kwargs.get("expert_parallel_size", 1)
        dims = ParallelDims(world_size=2, tp=1 if ep > 1 else 2)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        module = _build(name, implementation)
        disable_kv_cache(module)  # as the strategy does before checkpointing
        before = {m: set(vars(m)) for m in module.modules()}
        names = {m: n for n, m in module.named_modules()}

        def checkpoint(blocks, entries):
            apply_activation_checkpointing(blocks, mode="full", entries=entries)

        parallelize(module, dims, zero_stage=0, activation_checkpointing=checkpoint if checkpointed else None, **kwargs)
        module.training_step(tokens()[:4], 0).backward()
        added = {}
        for m, keys in before.items():
            new = sorted(k for k in set(vars(m)) - keys if k.startswith("_") and not _torch_owned(k))
            if new:
                added[names[m]] = new
        found[layout] = added
    return found if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def added_names():
    return run_distributed(_new_private_names, 2, list(LAYOUTS), timeout=240)[0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_private_attribute_is_left_on_user_modules(added_names, layout):
    assert added_names[layout] == {}, f"{layout}: the package left state on the user's modules: {added_names[layout]}"


def _nested_loans() -> dict:
    """On one rank: loans taken inside a call already holding one, and calls nested through the hooks."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lightning_llm.parallel.lent_weights import lend, lend_during_calls, restore

    mesh = init_device_mesh("cpu", (1,))
    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    outer = lend(layer, ["weight"])
    inner = lend(layer, ["weight"])
    seen = {
        "outer lends": not isinstance(layer.weight, DTensor) and list(outer.taken) == ["weight"],
        "inner takes nothing, computes with the same": not inner.taken and inner.local[0] is outer.local[0],
    }
    restore(inner)
    seen["inner restore keeps the outer loan"] = not isinstance(layer.weight, DTensor)
    restore(outer)
    seen["outer restore puts the DTensor back"] = isinstance(layer.weight, DTensor)

    class Recursive(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)]))
            self.inside = []

        def forward(self, x, depth):
            self.inside.append(type(self.weight).__name__)
            return x @ self.weight if depth == 0 else self(x, depth - 1) @ self.weight

    module = Recursive()
    lend_during_calls(module, ["weight"])
    module(torch.ones(1, 2), 2)
    seen["nested calls compute with local tensors"] = set(module.inside) == {"Tensor"}
    seen["nested calls end with the DTensor back"] = isinstance(module.weight, DTensor)
    return seen


@pytest.mark.distributed
def test_loans_nest_and_the_outermost_restore_puts_the_dtensor_back():
    seen = run_distributed(_nested_loans, 1)[0]
    assert all(seen.values()), seen
