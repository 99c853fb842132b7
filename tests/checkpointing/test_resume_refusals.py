"""A checkpoint that does not fit the model is refused before the first resumed step on every resume path (issue 53).

The case: the tiny reference model saved with untied embeddings, resumed into the same model built with
``tie_embeddings=True``. Names and shapes match (a tied model lists both names), so without a check one tensor is
loaded twice, one of the two saved values is kept, and training goes on off the straight run. It is refused under
LLMParallelStrategy's sharded (ZeRO-3) and single-file checkpoints, DeepSpeed ZeRO-3, and Lightning's DDP (with
``ResumeChecks``, which ``lightning-llm fit`` adds; or ``CheckpointRotation``'s verified load). The other way, a tied
checkpoint into an untied model, the weights load equal (untying) and the optimizer state the checkpoint lacks is
named.

One 2-rank job runs the distributed cases; the tests read its results.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.callbacks import CheckpointRotation, ResumeChecks
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import cpu_trainer, run_distributed
from tests._optional import HAS_DEEPSPEED, requires_deepspeed
from tests.strategies._parity import GlobalLoss, data

pytestmark = pytest.mark.timeout(900)
SAVED = "step=00000002.ckpt"
UNTIED_INTO_TIED = "which this model ties (one tensor, e.g. tie_embeddings=True): it was saved from a model with untied"


def _model(tied: bool) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(LlamaConfig.from_name("tiny", n_layers=2, tie_embeddings=tied), warmup_steps=2, max_steps=10)


def _strategy(path: str):
    from lightning_llm.strategies import LLMDeepSpeedStrategy, LLMParallelStrategy

    if path == "deepspeed zero3":
        return LLMDeepSpeedStrategy(
            zero_stage=3, config={"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        )
    if path in ("ddp", "auto"):
        return path
    return LLMParallelStrategy(zero_stage=3, save_distributed_checkpoint=path == "zero3 sharded")


def _resume(
    root: str, path: str, saved_tied: bool, resumed_tied: bool, devices: int = 2, callbacks=()
) -> tuple[str | None, list[float]]:
    """Train 2 steps with ``saved_tied``, save, resume with ``resumed_tied``: (the refusal or None, resumed losses)."""
    save = CheckpointRotation(dirpath=f"{root}/{path}-{saved_tied}-{resumed_tied}", every_n_train_steps=2)
    # CheckpointRotation is a ModelCheckpoint: checkpointing enabled
    kwargs = dict(devices=devices, default_root_dir=root, limit_val_batches=0, enable_checkpointing=True)
    cpu_trainer(max_steps=2, callbacks=[save], strategy=_strategy(path), **kwargs).fit(_model(saved_tied), data(4))
    losses = GlobalLoss()
    trainer = cpu_trainer(max_steps=3, callbacks=[losses, *callbacks], strategy=_strategy(path), **kwargs)
    try:
        trainer.fit(_model(resumed_tied), data(4), ckpt_path=f"{save.dirpath}/{SAVED}")
    except ValueError as err:
        return str(err), losses.losses
    return None, losses.losses


def _straight(path: str) -> list[float]:
    """The tied model's 3 steps without a break: the oracle of a tied checkpoint resumed."""
    losses = GlobalLoss()
    trainer = cpu_trainer(devices=2, max_steps=3, callbacks=[losses], strategy=_strategy(path), limit_val_batches=0)
    trainer.fit(_model(True), data(4))
    return losses.losses


CASES = {  # name: (resume path, saved tied, resumed tied, callbacks of the resumed run)
    "zero3 sharded, untied into tied": ("zero3 sharded", False, True, ()),
    "zero3 single file, untied into tied": ("zero3 single file", False, True, ()),
    "zero3 sharded, tied into untied": ("zero3 sharded", True, False, ()),
    "ddp with ResumeChecks, untied into tied": ("ddp", False, True, (ResumeChecks(),)),
    **({"deepspeed zero3, untied into tied": ("deepspeed zero3", False, True, ())} if HAS_DEEPSPEED else {}),
    # The same model on both sides resumes (the checks pass a tied checkpoint).
    "zero3 sharded, tied into tied": ("zero3 sharded", True, True, ()),
    "zero3 single file, tied into tied": ("zero3 single file", True, True, ()),
    "ddp with ResumeChecks, tied into tied": ("ddp", True, True, (ResumeChecks(),)),
}


def _every_case(root: str) -> dict:
    results = {
        name: _resume(root, path, saved, resumed, callbacks=extra)
        for name, (path, saved, resumed, extra) in CASES.items()
    }
    return {**results, "straight zero3": _straight("zero3 sharded"), "straight ddp": _straight("ddp")}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    return run_distributed(_every_case, 2, str(tmp_path_factory.mktemp("resume")), timeout=800)[0]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case",
    [
        "zero3 sharded, untied into tied",
        "zero3 single file, untied into tied",
        "ddp with ResumeChecks, untied into tied",
    ],
)
def test_an_untied_checkpoint_is_refused_by_a_tied_model(refusals, case):
    error, losses = refusals[case]
    assert error is not None and losses == [], refusals[case]
    assert f"{SAVED} holds different values for model.tok_embeddings.weight and model.output.weight" in error
    assert UNTIED_INTO_TIED in error and "tie_embeddings=False" in error  # the fix


@requires_deepspeed
@pytest.mark.distributed
def test_an_untied_deepspeed_checkpoint_is_refused_by_a_tied_model(refusals):
    error, losses = refusals["deepspeed zero3, untied into tied"]
    assert error is not None and losses == [], error
    assert "holds model.tok_embeddings.weight and model.output.weight as separate parameters" in error
    assert UNTIED_INTO_TIED in error


@pytest.mark.distributed
def test_a_tied_checkpoint_into_an_untied_model_names_the_optimizer_state_it_lacks(refusals):
    error, losses = refusals["zero3 sharded, tied into untied"]
    assert error is not None and losses == [], error
    assert f"{SAVED} holds no optimizer state for 1 (model.output.weight)" in error and "strict_loading" in error


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case, straight",
    [("zero3 sharded", "zero3"), ("zero3 single file", "zero3"), ("ddp with ResumeChecks", "ddp")],
)
def test_a_tied_checkpoint_resumes_into_the_same_tied_model_as_the_straight_run(refusals, case, straight):
    """The checks let the same model through; its step 3 is the straight run's (the single file's tied optimizer
    state crashed the first step before: it was keyed by the tied parameter's second name)."""
    error, losses = refusals[f"{case}, tied into tied"]
    assert error is None and losses == pytest.approx(refusals[f"straight {straight}"][2:], rel=1e-6)


@pytest.mark.parametrize("callback", [ResumeChecks, lambda: CheckpointRotation(every_n_train_steps=100)])
def test_single_device_refuses_an_untied_checkpoint_for_a_tied_model(tmp_path, callback):
    """Lightning's single-device strategy: ResumeChecks or CheckpointRotation's verified load refuse it."""
    error, losses = _resume(str(tmp_path), "auto", False, True, devices=1, callbacks=(callback(),))
    assert error is not None and losses == []
    assert UNTIED_INTO_TIED in error and SAVED in error
