"""Resume exactness under LLMParallelStrategy: a straight run vs the same run interrupted three times, across
two epoch boundaries, on 2 ranks (dp2, ZeRO-3, tp2, pp2), a chain that changes layout and dp size, and one that
switches context parallelism (ring and Ulysses) on and off.

The oracle is the straight run in the same layout; per-step global losses and every final parameter must agree
within 1e-7 relative, and each epoch must keep its number of batches.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llm.data import LLMDataModule
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import full_state, make_model

pytestmark = pytest.mark.timeout(600)  # the fixture trains 28 runs on 2 ranks
STEPS, GLOBAL_BATCH = 8, 8
STOPS = [2, 4, 7, STEPS]  # epochs of 3 batches: the run crosses boundaries after steps 3 and 6
LAYOUTS = {
    "dp2": {"zero_stage": 0},
    "zero3": {"zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "num_microbatches": 2},
}
# Layout and data-parallel size change at every resume (dp 2 -> 1 -> 2 -> 1).
CHAIN = ["zero3", "tp2", "dp2", "pp2"]
# Context parallelism on and off (C 2 -> 1 -> 2 -> 1, dp 1 -> 2 -> 1 -> 2; FSDP over dp_shard_cp throughout).
CP = {
    "cp2": {"context_parallel_size": 2},
    "cp2_ulysses": {"context_parallel_size": 2, "context_parallel_method": "ulysses"},
}
CP_CHAIN = ["cp2", "zero3", "cp2_ulysses", "dp2"]


class _Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.epochs: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / dist.get_world_size())
        self.epochs.append(trainer.current_epoch)


def _fit(layout: str, until: int, root: Path, resume_from=None):
    options = {**LAYOUTS, **CP}[layout]
    dp = 2 // options.get("tensor_parallel_size", 1) // options.get("pipeline_parallel_size", 1)
    dp //= options.get("context_parallel_size", 1)
    record, callbacks = _Record(), []
    if until < STEPS:
        callbacks.append(
            ModelCheckpoint(
                dirpath=root,
                filename=f"step{until}",
                every_n_train_steps=until,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    model = make_model("reference")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=LLMParallelStrategy(**options),
        max_steps=until,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, *callbacks],
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=0.5,
    )
    data = LLMDataModule(num_tokens=3 * GLOBAL_BATCH * 32 + 1, seq_len=32, batch_size=GLOBAL_BATCH // dp, seed=5)
    trainer.fit(model, data, ckpt_path=resume_from)
    return record, model


def _chain(layouts: list[str], root: Path):
    losses, epochs, previous = [], [], None
    for layout, until in zip(layouts, STOPS, strict=True):
        record, model = _fit(layout, until, root, resume_from=previous)
        losses += record.losses
        epochs += record.epochs
        previous = root / f"step{until}.ckpt"
    return losses, epochs, full_state(model)


def _all_runs(root: str) -> dict | None:
    results = {}
    for layout in LAYOUTS:
        straight, model = _fit(layout, STEPS, Path(root) / layout / "straight")
        results[layout] = {
            "straight": (straight.losses, straight.epochs, full_state(model)),
            "interrupted": _chain([layout] * len(STOPS), Path(root) / layout / "pieces"),
        }
    results["chain"] = _chain(CHAIN, Path(root) / "chain")
    results["cp chain"] = _chain(CP_CHAIN, Path(root) / "cp_chain")
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all_runs, 2, str(tmp_path_factory.mktemp("resume")), timeout=540)[0]


def _assert_close(got, want, label: str, rtol: float) -> None:
    (losses, epochs, params), (ref_losses, ref_epochs, ref_params) = got, want
    assert Counter(epochs) == Counter(ref_epochs) == {0: 3, 1: 3, 2: 2}, f"{label}: batches per epoch"
    assert epochs == ref_epochs
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0, msg=lambda m: f"{label} losses: {m}"
    )
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        error = (params[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert error <= rtol, f"{label} {name}: relative error {error:.2e} > {rtol:.0e}"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_three_interruptions_match_the_straight_run(runs, layout):
    _assert_close(runs[layout]["interrupted"], runs[layout]["straight"], layout, rtol=1e-7)


@pytest.mark.distributed
def test_resume_changing_layout_and_dp_size_matches_the_straight_run(runs):
    # Different layouts sum in different orders: the cross-layout parity tolerance of the strategy tests.
    _assert_close(runs["chain"], runs["zero3"]["straight"], "zero3 -> tp2 -> dp2 -> pp2", rtol=1e-5)


@pytest.mark.distributed
def test_resume_across_a_context_parallel_size_change_matches_the_straight_run(runs):
    # The sharded checkpoint of a cp2 run (parameters sharded over the two CP ranks) resumes without CP and back.
    _assert_close(runs["cp chain"], runs["zero3"]["straight"], " -> ".join(CP_CHAIN), rtol=1e-5)
