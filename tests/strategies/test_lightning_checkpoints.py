"""A checkpoint of any of Lightning's own strategies resumes under LLMParallelStrategy, in any layout, and continues
as the saving strategy's own resume does.

Each source trains the tiny reference model (AdamW in two groups, warmup schedule) 2 steps and saves in the loop:
one device (Lightning's default strategy), DDP, ``FSDPStrategy`` with full and with sharded state dicts,
``ModelParallelStrategy`` (FSDP2 applied by hand in ``configure_model``, sharded save) and DeepSpeed ZeRO 2 and 3
(read through DeepSpeed's own consolidation), all on 2 ranks but the first. The oracle is the source's own resume to
step 4; the same checkpoint resumed under LLMParallelStrategy with ZeRO-3, tp2 and pp2 on 2 ranks (and on one
device for the one-device checkpoint) must give steps 3-4's global losses and every parameter within 1e-5, with
optimizer state, schedulers, loops and data position carried over. Before this, the one-device checkpoint failed
under ``LLMParallelStrategy()`` with Lightning's "Could not find a distributed model", and the sharded ones of
FSDPStrategy and ModelParallelStrategy with DCP's "Missing key in checkpoint state_dict".

Lightning's FSDP and DeepSpeed strategies refuse CPU: :mod:`tests.strategies._lightning_sources` says how they run
here. All 2-rank runs share one process group (33 fits).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy

from lightning_llm.checkpointing.consolidate import consolidate_checkpoint, read_model_state
from lightning_llm.testing import run_distributed
from tests.strategies._lightning_sources import SOURCES, HandShardedLM, source_strategy
from tests.strategies._parity import GLOBAL_BATCH, GlobalLoss, assert_parity, data, full_state, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
SAVED_AT, STEPS = 2, 4
LAYOUTS = {  # LLMParallelStrategy arguments, data-parallel ranks
    "zero3": ({"zero_stage": 3}, 2),
    "tp2": ({"tensor_parallel_size": 2}, 1),
    "pp2": ({"pipeline_parallel_size": 2, "num_microbatches": 2}, 1),
}


def _fit(strategy, *, devices: int, dp: int, steps: int, model=None, save_to=None, resume_from=None):
    """Fit the reference model to ``steps`` (saving at that step to ``save_to``, from ``resume_from``); the global
    losses of the steps it trained and every parameter, whole."""
    model = make_model("reference") if model is None else model
    callbacks: list = [GlobalLoss()]
    if save_to is not None:
        name = Path(save_to)
        callbacks.append(
            ModelCheckpoint(
                dirpath=name.parent,
                filename=name.stem,
                every_n_train_steps=steps,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=save_to is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data(GLOBAL_BATCH // dp), ckpt_path=resume_from)
    # FSDP1's root wraps the LightningModule: only the root gathers whole parameters.
    whole = trainer.strategy.model if isinstance(trainer.strategy, FSDPStrategy) else model
    return callbacks[0].losses, full_state(whole)


def _resumed_under_layouts(checkpoint: Path) -> dict:
    from lightning_llm.strategies import LLMParallelStrategy

    return {
        label: _fit(LLMParallelStrategy(**kwargs), devices=2, dp=dp, steps=STEPS, resume_from=checkpoint)
        for label, (kwargs, dp) in LAYOUTS.items()
    }


def _two_ranks(root: str) -> dict | None:
    """Every source on 2 ranks (save, its own resume, the three layouts), and the one-device checkpoint's layouts."""
    results = {}
    for source in SOURCES:
        model = (lambda: HandShardedLM()) if source == "model_parallel" else (lambda: None)
        checkpoint = Path(root) / f"{source}.ckpt"
        _fit(source_strategy(source), devices=2, dp=2, steps=SAVED_AT, model=model(), save_to=checkpoint)
        own = _fit(source_strategy(source), devices=2, dp=2, steps=STEPS, model=model(), resume_from=checkpoint)
        results[source] = {"own": own, **_resumed_under_layouts(checkpoint)}
    results["one_device"] = _resumed_under_layouts(Path(root) / "one_device.ckpt")
    return results if dist.get_rank() == 0 else None


def _one_device_under_the_strategy(root: str):
    from lightning_llm.strategies import LLMParallelStrategy

    return _fit(LLMParallelStrategy(), devices=1, dp=1, steps=STEPS, resume_from=Path(root) / "one_device.ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_checkpoints")
    _fit("auto", devices=1, dp=1, steps=SAVED_AT, save_to=root / "one_device.ckpt")  # in this process: no group
    results = run_distributed(_two_ranks, 2, str(root), timeout=560)[0]
    results["one_device"]["own"] = _fit("auto", devices=1, dp=1, steps=STEPS, resume_from=root / "one_device.ckpt")
    results["one_device"]["one device"] = run_distributed(_one_device_under_the_strategy, 1, str(root), timeout=120)[0]
    return results, root


@pytest.mark.parametrize("source", [*SOURCES, "one_device"])
def test_a_lightning_checkpoint_resumes_under_every_layout_as_its_own_strategy_continues(runs, source):
    runs, _ = runs
    own = runs[source]["own"]
    assert len(own[0]) == STEPS - SAVED_AT
    for layout in [*LAYOUTS, *(["one device"] if source == "one_device" else [])]:
        assert_parity(runs[source][layout], own, f"{source} -> {layout}", rtol=1e-5)


def test_every_sources_checkpoint_exports_and_consolidates(runs, tmp_path):
    """``lightning-llm export`` reads them all (FSDP's ``model.`` keys, DeepSpeed through its consolidation): the
    weights equal DDP's after the same two steps, and DeepSpeed's optimizer moments too, in torch's layout."""
    _, root = runs
    # FSDP1 trains without the weight decay the groups meant (see docs/checkpointing.md): its own reference.
    ddp, fsdp = read_model_state(root / "ddp.ckpt")[0], read_model_state(root / "fsdp_full.ckpt")[0]
    for source in [*SOURCES, "one_device"]:
        state, rest = read_model_state(root / f"{source}.ckpt")
        assert rest["global_step"] == SAVED_AT, source
        want = fsdp if source.startswith("fsdp") else ddp
        assert state.keys() == want.keys(), source
        for name, ref in want.items():  # relative error of the whole tensor, as assert_parity measures it
            assert (state[name] - ref).norm() <= 1e-5 * ref.norm(), f"{source} {name}"
    if "deepspeed" in SOURCES:
        full = torch.load(consolidate_checkpoint(root / "deepspeed.ckpt", tmp_path / "ds.ckpt"), weights_only=False)
        ddp = torch.load(root / "ddp.ckpt", weights_only=False)["optimizer_states"][0]
        torch.testing.assert_close(full["optimizer_states"][0]["state"], ddp["state"], rtol=1e-5, atol=1e-9)
