"""LLMParallelStrategy beyond plain parity: arguments, presets, bad input, accumulation, validation, checkpoints."""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_llm.checkpointing.consolidate import consolidate_checkpoint
from lightning_llm.parallel.mesh import ParallelDims
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from tests.parallel._collectives import counting_reduce_scatters
from tests.strategies._parity import STEPS, assert_parity, data, full_state, make_model, train


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"zero_stage": 4}, r"zero_stage=4 is not one of 0, 1, 2, 3, 'auto'"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be an integer >= 1"),
        ({"sequence_parallel": True}, "sequence_parallel=True needs tensor_parallel_size > 1"),
        ({"zero_stage": 0, "data_parallel_replicate_size": 2}, "HSDP\\) needs zero_stage 2 or 3"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMParallelStrategy(**kwargs)


def test_world_size_must_factor_into_the_degrees():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp \(4\)"):
        ParallelDims(world_size=6, tp=4)
    with pytest.raises(ValueError, match=r"= 8, but the world size is 4"):
        ParallelDims(world_size=4, tp=2, dp_shard=4)
    assert ParallelDims(world_size=8, tp=2, dp_replicate=2).dp_shard == 2


def test_presets_are_registered():
    strategy = StrategyRegistry.get("llm_tp2_sp")
    assert isinstance(strategy, LLMParallelStrategy)
    assert strategy._tensor_parallel_size == 2 and strategy.sequence_parallel
    assert StrategyRegistry.get("llm_ddp").zero_stage == 0
    plain = StrategyRegistry.get("llm_parallel")
    assert type(plain) is LLMParallelStrategy and plain.zero_stage == LLMParallelStrategy().zero_stage
    assert (
        type(L.Trainer(strategy="llm_parallel", accelerator="cpu", devices=1, logger=False).strategy)
        is LLMParallelStrategy
    )


class _NoLinear(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.LayerNorm(8) for _ in range(2))
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        return sum(layer(batch.float()[..., :8]).sum() for layer in self.layers)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_expecting_error(make_module, strategy_kwargs, world_size):
    module = make_module()
    try:  # an unknown style is refused by the constructor, the rest at setup: before the first step either way
        trainer = cpu_trainer(devices=world_size, strategy=LLMParallelStrategy(**strategy_kwargs), max_steps=2)
        trainer.fit(module, data(2))
    except ValueError as err:
        return str(err), getattr(module, "steps_run", 0)
    return None, getattr(module, "steps_run", 0)


def _bad_inputs(world_size):
    cases = [
        (_NoLinear, {"tensor_parallel_size": 2}),
        (
            lambda: make_model("reference"),
            {"tensor_parallel_size": 2, "tensor_parallel_plan": {"layers.*.nope": "colwise"}},
        ),
        (
            lambda: make_model("reference"),
            {"tensor_parallel_size": 2, "tensor_parallel_plan": {"model.output": "sideways"}},
        ),
        (lambda: make_model("reference"), {"data_parallel_size": 3}),
        (lambda: make_model("reference"), {"blocks": "model.missing"}),
    ]
    return [_fit_expecting_error(factory, kwargs, world_size) for factory, kwargs in cases]


@pytest.mark.distributed
def test_bad_input_is_refused_before_the_first_step():
    messages = run_distributed(_bad_inputs, 2, 2, timeout=180)[0]
    expected = [
        "contain no nn.Linear (or Conv1D) layer to shard",
        "pattern 'layers.*.nope' matches no module",
        "Unknown tensor-parallel style 'sideways'",
        "data_parallel_size (3) * tensor_parallel_size (1) * pipeline_parallel_size (1) = 3, but there are 2 processes",
        "blocks='model.missing' names no submodule",
    ]
    for (message, steps_run), fragment in zip(messages, expected):
        assert message is not None and fragment in message, message
        assert steps_run == 0


def _accumulation_and_validation(world_size):
    # Counting FSDP2's gradient reduce-scatters shows whether accumulation micro-batches skipped them (as asked:
    # by default they reduce-scatter, see test_accumulation_sync.py).
    with counting_reduce_scatters() as calls:
        accumulated = train(
            "reference",
            LLMParallelStrategy(zero_stage=3, accumulation_sync="last_micro_batch"),
            devices=world_size,
            dp=world_size,
            accumulate=2,
        )

    model = make_model("hf_llama")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=LLMParallelStrategy(tensor_parallel_size=2),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=4,
    )
    val_loss = trainer.validate(model, data(4), verbose=False)[0]["val_loss"]
    return accumulated, calls["reduce_scatter"], val_loss


@pytest.mark.distributed
def test_accumulation_syncs_once_per_step_and_validate_matches():
    accumulated, reduce_scatters, val_loss = run_distributed(_accumulation_and_validation, 2, 2, timeout=240)[0]
    assert_parity(accumulated, train("reference", accumulate=2), "zero3 with accumulate_grad_batches=2")
    # 3 FSDP units (2 blocks + the root) reduce once per optimizer step, not once per micro-batch.
    assert reduce_scatters == 3 * STEPS
    single = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=4
    ).validate(make_model("hf_llama"), data(4), verbose=False)[0]["val_loss"]
    assert val_loss == pytest.approx(single, rel=1e-6)


def _save_then_resume_in_other_layouts(world_size, root):
    root = Path(root)
    first = train(
        "reference",
        LLMParallelStrategy(tensor_parallel_size=2, zero_stage=3),
        devices=world_size,
        dp=2,
        steps=STEPS // 2,
        save_to=root / "half.ckpt",
    )
    # Load into dp4 ZeRO-3 and check the parameters arrived whole.
    loaded = make_model("reference")
    L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=LLMParallelStrategy(zero_stage=3),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
    ).validate(loaded, data(2), ckpt_path=root / "half.ckpt", verbose=False)
    loaded_state = full_state(loaded)
    # Resume training in the new layout for the second half.
    second = train(
        "reference",
        LLMParallelStrategy(zero_stage=3),
        devices=world_size,
        dp=world_size,
        resume_from=root / "half.ckpt",
    )
    return first, loaded_state, second


@pytest.mark.distributed
def test_sharded_checkpoint_reshards_into_other_layouts(tmp_path):
    first, loaded_state, second = run_distributed(_save_then_resume_in_other_layouts, 4, 4, str(tmp_path), timeout=300)[
        0
    ]
    (first_losses, saved_state), (second_losses, final_state) = first, second
    for name, tensor in saved_state.items():
        torch.testing.assert_close(loaded_state[name], tensor, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")

    straight_losses, straight_state = train("reference")
    assert_parity(
        (first_losses + second_losses, final_state), (straight_losses, straight_state), "tp2xdp2 -> dp4 resume"
    )

    consolidated = consolidate_checkpoint(tmp_path / "half.ckpt", tmp_path / "half-full.pt")
    plain = make_model("reference")
    plain.configure_model()
    state = torch.load(consolidated, weights_only=False)
    plain.load_state_dict(state["state_dict"])
    assert state["global_step"] == STEPS // 2
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, saved_state[name], rtol=0, atol=0)


def _threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def _fits_in_one_process():
    # Two fits of the same layout, then one of another: the OS's thread count after each (gloo runs threads per group).
    counts, meshes = [], []
    for tp in (2, 2, 1):
        train("reference", LLMParallelStrategy(tensor_parallel_size=tp, zero_stage=3), devices=2, dp=2 // tp, steps=1)
        counts.append(_threads())
        meshes.append(ParallelDims(world_size=2, tp=tp).build_mesh("cpu"))
    return counts, [meshes[0] is meshes[1], meshes[1] is meshes[2]]


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_a_second_fit_in_one_process_takes_the_same_mesh_and_adds_no_threads():
    for counts, same in run_distributed(_fits_in_one_process, 2, timeout=240):
        assert same == [True, False]  # one mesh per shape
        assert counts[1] == counts[0], counts  # the second fit of a layout started no more gloo threads
