"""activation_checkpointing="auto" through LLMParallelStrategy, on 1 and 2 ranks (gloo, CPU), with the reference
model built eagerly and on the meta device (by ``configure_model`` inside ``fit``): it trains, the activation
memory it keeps stays within the budget (measured independently of the planner: the bytes of the tensors the
blocks' forward created that are still alive when the forward ends), and its losses and parameters are those of
the same run without checkpointing (fp32, 1e-6)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_llm._compat.torch import TorchDispatchMode, tree_leaves
from lightning_llm._compat.torch_distributed import local_tensor
from lightning_llm.modeling.blocks import find_blocks
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import run_distributed
from tests.strategies._parity import assert_parity, data, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

BUDGET = 1_000_000  # bytes per rank: between full checkpointing of every block and none (asserted below)
STEPS, LAYERS, PER_RANK_BATCH = 3, 4, 2


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (local_tensor(t) if isinstance(t, DTensor) else t).untyped_storage()


class _BlockStorages(TorchDispatchMode):
    """Records every storage an op creates while a block's forward runs; :meth:`live` sums those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.in_block = 0
        # (weak ref, bytes at creation): a freed storage's address may be reused, so refs are told apart only by
        # whether they are alive when counted.
        self.created: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_block:
            # A view (of a weight, of an input) shares its argument's storage: not memory this op allocated.
            given = {StorageWeakRef(_storage(t)) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and StorageWeakRef(_storage(t)) not in given:
                    self.created.append((StorageWeakRef(_storage(t)), _storage(t).nbytes()))
        return out

    def live(self) -> int:
        return sum({ref.cdata: size for ref, size in self.created if not ref.expired()}.values())


class _Measured(CausalLM):
    """CausalLM recording, per training step, the bytes its blocks' forward left alive for backward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[int] = []
        self._recording = False

    def on_train_start(self) -> None:
        self._recording = True  # not in the planner's measuring forward, which runs on fake tensors in setup

    def training_step(self, batch, batch_idx):
        if not self._recording:
            return super().training_step(batch, batch_idx)
        mode = _BlockStorages()
        hooks = []
        for block in find_blocks(self)[1]:
            hooks.append(block.register_forward_pre_hook(lambda *_: setattr(mode, "in_block", mode.in_block + 1)))
            hooks.append(block.register_forward_hook(lambda *_: setattr(mode, "in_block", mode.in_block - 1)))
        try:
            with mode:
                loss = super().training_step(batch, batch_idx)
            self.kept.append(mode.live())
        finally:
            for hook in hooks:
                hook.remove()
        return loss


def _run(mode: str, build_on_meta: bool, world_size: int):
    torch.manual_seed(0)
    module = _Measured(LlamaConfig.from_name("tiny", n_layers=LAYERS), warmup_steps=1, max_steps=STEPS)
    if not build_on_meta:
        module.configure_model()  # eager, from this seed; otherwise built on meta inside fit() and materialized
    from lightning_llm.strategies import LLMParallelStrategy

    options = {"budget": BUDGET} if mode == "auto" else None
    strategy = LLMParallelStrategy(
        activation_checkpointing=mode, activation_checkpointing_options=options, zero_stage=0
    )
    losses, params = train(
        "reference",
        strategy,
        devices=world_size,
        dp=world_size,
        steps=STEPS,
        model=module,
        datamodule=data(PER_RANK_BATCH),
    )
    return (losses, params), module.kept


def _none_full_auto(world_size: int, build_on_meta: bool):
    runs = {mode: _run(mode, build_on_meta, world_size) for mode in ("none", "full", "auto")}
    return runs if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("build_on_meta", [True, False], ids=["meta", "eager"])
def test_auto_meets_its_budget_with_the_losses_of_no_checkpointing(world_size, build_on_meta):
    runs = run_distributed(_none_full_auto, world_size, world_size, build_on_meta, timeout=540)[0]
    (none, none_kept), (_, full_kept), (auto, auto_kept) = runs["none"], runs["full"], runs["auto"]
    # The budget binds: without checkpointing the blocks keep more, with every block checkpointed less.
    assert max(full_kept) < BUDGET < min(none_kept), (full_kept, BUDGET, none_kept)
    assert max(auto_kept) <= BUDGET, f"auto kept {auto_kept} bytes per step, budget {BUDGET}"
    assert len(auto[0]) == STEPS
    assert_parity(auto, none, f"auto on {world_size} rank(s)", rtol=1e-6)


def _eager_and_compiled(world_size: int):
    from lightning_llm.strategies import LLMParallelStrategy

    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        strategy = LLMParallelStrategy(
            activation_checkpointing="auto",
            activation_checkpointing_options={"budget": BUDGET},
            zero_stage=0,
            compile_blocks=compiled,
        )
        model = CausalLM(LlamaConfig.from_name("tiny", n_layers=LAYERS), warmup_steps=1, max_steps=STEPS)
        result = train(
            "reference",
            strategy,
            devices=world_size,
            dp=world_size,
            steps=STEPS,
            model=model,
            datamodule=data(PER_RANK_BATCH),
        )
        runs[compiled] = result, strategy.activation_checkpointing_policies
    return runs


@pytest.mark.compile
def test_auto_under_compile_blocks_checkpoints_the_eager_plan_and_trains_like_eager():
    # The plan is made on the eager model before the blocks are compiled, so compiling must not change it; the
    # compiled blocks (checkpointed and not) then train like the eager ones (fp32, inductor's reordering: 1e-5).
    runs = run_distributed(_eager_and_compiled, 1, 1, timeout=540)[0]
    (eager, eager_policies), (compiled, compiled_policies) = runs[False], runs[True]
    assert compiled_policies == eager_policies
    assert "none" in eager_policies and set(eager_policies) != {"none"}, eager_policies  # the budget binds
    assert len(compiled[0]) == STEPS
    assert_parity(compiled, eager, "auto, compiled vs eager", rtol=1e-5)
