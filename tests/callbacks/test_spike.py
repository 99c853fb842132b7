"""LossSpikeGuard: a NaN or spiking step is skipped on every rank without touching parameters or optimizer state."""

import copy
import re

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import LossSpikeError, LossSpikeGuard
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM
from lightning_llm.testing import cpu_trainer, run_distributed


class Faulty(CausalLM):
    """Multiplies the loss of one step by ``factor`` (NaN or a big number), on ``ranks`` only."""

    def __init__(self, bad_step: int, factor: float, ranks=(0,)):
        super().__init__("tiny", warmup_steps=1)
        self.bad_step, self.factor, self.ranks = bad_step, factor, ranks
        self.losses, self.snapshots = [], {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.bad_step and self.global_rank in self.ranks:
            loss = loss * self.factor
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step in (self.bad_step, self.bad_step + 1):
            optimizer = self.trainer.optimizers[0]
            self.snapshots[self.global_step] = (
                {n: p.detach().clone() for n, p in self.named_parameters()},
                copy.deepcopy(optimizer.state_dict()["state"]),
            )

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit(guard, model, devices=1, steps=8, strategy="auto"):
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[guard],
        limit_val_batches=0,
        gradient_clip_val=1.0,
    )
    trainer.fit(model, LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4))
    return trainer


def _assert_step_left_nothing(model, step):
    (before, state_before), (after, state_after) = model.snapshots[step], model.snapshots[step + 1]
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed in the skipped step"
    for index, state in state_before.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_after[index][key])), f"optimizer {key}"


def test_nan_step_is_skipped_and_training_goes_on(recwarn):
    model = Faulty(bad_step=4, factor=float("nan"))
    guard = LossSpikeGuard(action="skip", warmup_steps=2)
    trainer = _fit(guard, model)
    # optimizer.step is left as it is: no "optimizer.step() has been overridden" warning from the LR scheduler.
    assert not [w for w in recwarn if "overridden" in str(w.message)]
    _assert_step_left_nothing(model, 4)
    assert all(torch.isfinite(torch.tensor(model.losses[5:])))
    assert guard.counts == {"nonfinite": 1, "spikes": 0, "skipped": 1}
    assert trainer.callback_metrics["loss_guard/skipped"] == 1.0


def test_spike_is_detected_after_warmup():
    model = Faulty(bad_step=6, factor=50.0)
    guard = LossSpikeGuard(action="skip", warmup_steps=3, threshold=6.0)
    _fit(guard, model)
    _assert_step_left_nothing(model, 6)
    assert guard.counts == {"nonfinite": 0, "spikes": 1, "skipped": 1}


def test_stop_names_the_step_and_batches():
    with pytest.raises(LossSpikeError, match=r"non-finite loss .* at step 3 \(batch indices \[3\]\)"):
        _fit(LossSpikeGuard(action="stop"), Faulty(bad_step=3, factor=float("nan")))


def test_warn_keeps_training():
    guard = LossSpikeGuard(action="warn")
    with pytest.warns(UserWarning, match="non-finite loss"):
        _fit(guard, Faulty(bad_step=2, factor=float("inf")), steps=4)
    # The step was taken: the parameters are now non-finite and so is every later loss.
    assert guard.counts["skipped"] == 0 and guard.counts["nonfinite"] == 2


def _skip_on(strategy, world_size):
    torch.manual_seed(0)
    model = Faulty(bad_step=3, factor=float("nan"), ranks=(1,))  # only rank 1 sees the NaN
    guard = LossSpikeGuard(action="skip")
    _fit(guard, model, devices=world_size, strategy=strategy)
    before, after = model.snapshots[3][0], model.snapshots[4][0]
    return all(torch.equal(before[n], after[n]) for n in before), model.losses[-1], guard.counts["skipped"]


def _two_ranks(world_size):
    from lightning_llm.strategies import LLMParallelStrategy

    return {
        "dp2": _skip_on(LLMParallelStrategy(zero_stage=0), world_size),
        # Rank 1 holds the last stage: only its loss is NaN; the first stage must skip too.
        "pp2": _skip_on(LLMParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), world_size),
    }


@pytest.mark.distributed
def test_every_rank_skips_when_one_rank_sees_nan():
    results = run_distributed(_two_ranks, 2, 2, timeout=180)
    for layout in ("dp2", "pp2"):
        assert [r[layout][0] for r in results] == [True, True], f"{layout}: parameters changed in the skipped step"
        assert all(torch.isfinite(torch.tensor(r[layout][1])) for r in results), layout
        assert [r[layout][2] for r in results] == [1, 1], layout


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="action='pause' is not one of"):
        LossSpikeGuard(action="pause")
    with pytest.raises(ValueError, match="window=1 must be an integer >= 2"):
        LossSpikeGuard(window=1)
    model = Faulty(bad_step=-1, factor=1.0)
    model.configure_optimizers = lambda: torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS re-evaluates"):
        _fit(LossSpikeGuard(action="skip"), model, steps=1)


def test_statistics_survive_a_checkpoint(tmp_path):
    guard = LossSpikeGuard(action="skip", warmup_steps=2)
    trainer = _fit(guard, Faulty(bad_step=4, factor=float("nan")), steps=6)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    restored = LossSpikeGuard(action="skip", warmup_steps=2)
    # max_steps as saved: the resumed fit restores the state and stops, so what it holds is what it loaded.
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[restored],
        limit_val_batches=0,
    )
    trainer.fit(
        Faulty(bad_step=-1, factor=1.0),
        LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4),
        ckpt_path=tmp_path / "last.ckpt",
    )
    assert len(guard.history) == 5 and list(restored.history) == list(guard.history)
    assert restored.counts == guard.counts == {"nonfinite": 1, "spikes": 0, "skipped": 1}
    assert restored.state_dict()["steps_seen"] == 6


def test_spike_three_steps_after_resume_is_skipped_as_in_the_straight_run(tmp_path):
    """The issue's scenario: with warm-up 6, a x100 spike at step 8 right after resuming from step 5. A guard
    whose window and warm-up restarted on resume would let it through; the straight run is the oracle."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(steps, resume_from=None, checkpoint=None):
        L.seed_everything(0)
        guard, model = LossSpikeGuard(action="skip", warmup_steps=6, window=10), Faulty(bad_step=8, factor=100.0)
        model.hparams.max_steps = 11  # one LR schedule for every piece, not the Trainer's estimate of each
        callbacks = [guard] + ([checkpoint] if checkpoint else [])
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            limit_val_batches=0,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4), ckpt_path=resume_from)
        return guard, model

    straight_guard, straight = fit(11)
    fit(5, checkpoint=ModelCheckpoint(dirpath=tmp_path, filename="step5", every_n_train_steps=5))
    resumed_guard, resumed = fit(11, resume_from=tmp_path / "step5.ckpt")

    assert straight_guard.counts == {"nonfinite": 0, "spikes": 1, "skipped": 1}
    assert resumed_guard.counts == straight_guard.counts
    _assert_step_left_nothing(resumed, 8)
    assert resumed.losses == straight.losses[5:]
    for name, param in resumed.named_parameters():
        assert torch.equal(param, dict(straight.named_parameters())[name]), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": float("nan")}, "threshold=nan must be a finite number"),
        ({"threshold": float("inf")}, "threshold=inf must be a finite number"),
        ({"threshold": "6"}, "threshold='6' must be a number"),
        ({"threshold": True}, "threshold=True must be a number"),
        ({"threshold": 0}, "threshold=0 must be a number > 0"),
        ({"window": 10.0}, "window=10.0 must be an integer"),
        ({"window": "10"}, "window='10' must be an integer"),
        ({"window": True}, "window=True must be an integer"),
        ({"warmup_steps": float("nan")}, "warmup_steps=nan must be an integer"),
        ({"warmup_steps": -1}, "warmup_steps=-1 must be an integer >= 0"),
    ],
)
def test_bad_statistics_arguments_are_refused(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        LossSpikeGuard(**kwargs)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_a_step_without_gradients_changes_no_adamw_state(impl):
    # The skip drops every gradient; torch's AdamW (both fast paths) must then leave parameters, moments
    # and step counts exactly as they were.
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **{impl: True})
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()["state"])
    model(torch.randn(2, 4)).sum().backward()
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    for index, values in state.items():
        for key, value in values.items():
            assert torch.equal(value, optimizer.state_dict()["state"][index][key]), key


class _Fp16Scaled(Faulty):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_skip_under_fp16_grad_scaler():
    # Lightning unscales before on_before_optimizer_step, so the GradScaler has its inf checks when the
    # guard drops the gradients; its step then runs an optimizer step that changes nothing.
    from lightning.pytorch.plugins.precision import MixedPrecision

    model = _Fp16Scaled(bad_step=6, factor=50.0)  # a finite spike: the scaler itself would not skip
    guard = LossSpikeGuard(action="skip", warmup_steps=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = cpu_trainer(
        devices=1,
        max_steps=8,
        callbacks=[guard],
        limit_val_batches=0,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
    )
    trainer.fit(model, LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4))
    assert guard.counts == {"nonfinite": 0, "spikes": 1, "skipped": 1} and trainer.global_step == 8
    _assert_step_left_nothing(model, 6)
