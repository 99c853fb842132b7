"""The strategy contract: both strategies implement it, and every callback works under Lightning's own strategies."""

import types
import uuid

import fsspec
import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_llm.callbacks import CheckpointRotation, GradNormMonitor, MFUMonitor
from lightning_llm.checkpointing.files import complete_checkpoints, read_marker
from lightning_llm.contract import ParallelLayout, contract_of, implements_contract
from lightning_llm.contract.lightning import LightningContract
from lightning_llm.strategies import LLMDeepSpeedStrategy, LLMParallelStrategy
from lightning_llm.testing import cpu_trainer, run_distributed
from tests._optional import HAS_DEEPSPEED, requires_deepspeed
from tests.strategies._parity import data, make_model

SEQ = 32


def test_both_strategies_implement_the_contract_and_others_get_the_fallback():
    assert implements_contract(LLMParallelStrategy())
    assert not HAS_DEEPSPEED or implements_contract(LLMDeepSpeedStrategy())  # DeepSpeed is an optional extra
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert not implements_contract(trainer.strategy)
    contract = contract_of(trainer)
    assert isinstance(contract, LightningContract) and implements_contract(contract)
    assert contract.layout == ParallelLayout(strategy="SingleDeviceStrategy", world_size=1)
    assert contract.layout.as_dict()["dp"] == 1 and contract.supports_async_save


class TorchNorm(L.Callback):
    """The oracle: torch's own norm of the gradients Lightning is about to step with."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.nn.utils.get_total_norm(grads).item())


def _fit(tmp: str, devices: int, callbacks: list) -> L.Trainer:
    model = make_model("reference")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=4,
        logger=False,
        log_every_n_steps=1,
        enable_checkpointing=any(isinstance(c, CheckpointRotation) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        limit_val_batches=0,
        default_root_dir=tmp,
    )
    trainer.fit(model, data(8 // devices))
    return trainer


def _under_ddp(world_size: int, tmp: str) -> dict:
    import types

    import lightning_llm.callbacks.mfu as mfu
    from tests.callbacks.test_mfu import FakeClock

    mfu.time = types.SimpleNamespace(perf_counter=FakeClock().perf_counter)  # every logging window lasts 1 s
    monitors = [
        GradNormMonitor(),
        MFUMonitor(log_every_n_steps=2, peak_flops=1e12),
        CheckpointRotation(dirpath=tmp, every_n_train_steps=2, keep_last=1, async_save=True),
    ]
    trainer = _fit(tmp, world_size, monitors)
    metrics = trainer.callback_metrics
    return {
        "layout": contract_of(trainer).layout,
        "norm": metrics["grad_norm/total"].item(),
        "samples_per_sec": metrics["train/samples_per_sec"].item(),
        "tokens_per_sec": metrics["train/items_per_sec"].item(),
        "tokens_seen": monitors[2].tokens_seen,
    }


@pytest.mark.distributed
def test_callbacks_under_lightnings_ddp_use_the_fallback(tmp_path):
    results = run_distributed(_under_ddp, 2, 2, str(tmp_path), timeout=240)
    oracle = TorchNorm()
    _fit(str(tmp_path / "single"), 1, [oracle])
    for rank, result in enumerate(results):
        assert result["layout"] == ParallelLayout(strategy="DDPStrategy", world_size=2, dp_replicate=2, dp_rank=rank)
        # DDP averages the two half-batches' gradients: the norm of the full batch's gradient, on every rank.
        assert result["norm"] == pytest.approx(oracle.norms[-1], rel=1e-5)
        # Both replicas' samples count: 8 per step globally, 2 steps per one-second window, 32 tokens each.
        assert result["samples_per_sec"] == pytest.approx(2 * 8) and result["tokens_per_sec"] == pytest.approx(
            2 * 8 * SEQ
        )
        assert result["tokens_seen"] == 4 * 8 * SEQ
    (newest,) = complete_checkpoints(tmp_path)
    meta = read_marker(newest)
    assert meta["step"] == 4 and meta["layout"]["dp"] == 2 and meta["layout"]["strategy"] == "DDPStrategy"
    assert torch.load(newest, weights_only=False)["global_step"] == 4  # the thread-written file loads


# The members callbacks read instead of probing the strategy, under Lightning's own strategies.


class SpyIO(TorchCheckpointIO):
    """The oracle for the CheckpointIO members: counts the saves and loads that reach the strategy's CheckpointIO."""

    def __init__(self) -> None:
        self.saves = self.loads = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.loads += 1
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def test_single_device_checkpoints_through_its_checkpoint_io_and_to_urls(tmp_path):
    spy = SpyIO()
    trainer = cpu_trainer(
        devices=1,
        max_steps=1,
        plugins=[spy],
        limit_val_batches=0,
    )
    trainer.fit(make_model("reference"), data(2))
    contract = contract_of(trainer)
    assert isinstance(contract, LightningContract)
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    trainer.strategy.load_checkpoint(tmp_path / "one.ckpt")
    assert (spy.saves, spy.loads) == (1, 1)
    assert contract.saves_through_checkpoint_io and contract.loads_through_checkpoint_io
    url = f"memory://contract-{uuid.uuid4().hex}/one.ckpt"
    trainer.save_checkpoint(url)  # written through fsspec, not as a local directory named like the URL
    assert fsspec.filesystem("memory").exists(url.removeprefix("memory://")) and contract.saves_to_urls
    # The norm is read before the step, from the gradients; the step is a torch optimizer's, so it can be skipped.
    assert contract.grad_norm_ready == "before_optimizer_step" and contract.step_grad_norm() is None
    assert contract.can_skip_optimizer_step
    # One process: nothing to reduce, the tensor comes back as it is (the same object, in place).
    values = torch.tensor([1.5, -2.0])
    for op in ("sum", "mean", "max"):
        assert contract.reduce_across_ranks(values, op) is values and values.tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="op='avg'"):
        contract.reduce_across_ranks(values, "avg")


def test_strategies_writing_their_own_checkpoints_are_told_apart_before_setup():
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    strategies = [FSDPStrategy(), ModelParallelStrategy()]
    strategies += [DeepSpeedStrategy()] if HAS_DEEPSPEED else []  # optional: checked where installed
    for strategy in strategies:
        contract = contract_of(strategy)  # a strategy alone: only the checkpoint members answer
        assert isinstance(contract, LightningContract)
        assert not contract.saves_through_checkpoint_io and not contract.loads_through_checkpoint_io
        assert not contract.saves_to_urls, type(strategy).__name__
        with pytest.raises(RuntimeError, match="only the members about how it checkpoints"):
            contract.layout  # noqa: B018
    assert contract_of(LLMParallelStrategy()).saves_to_urls  # sharded DCP checkpoints by default
    assert not contract_of(LLMParallelStrategy(save_distributed_checkpoint=False)).saves_to_urls
    if HAS_DEEPSPEED:
        assert not contract_of(LLMDeepSpeedStrategy()).saves_to_urls


@requires_deepspeed
def test_lightnings_deepspeed_reads_the_engines_norm_after_its_step():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy()
    contract = LightningContract(types.SimpleNamespace(strategy=strategy))
    assert contract.grad_norm_ready == "after_optimizer_step" and not contract.can_skip_optimizer_step
    # The oracle: whatever the engine reports for its last step (None before it computed any).
    engine = types.SimpleNamespace(norm=None, get_global_grad_norm=lambda: engine.norm)
    strategy.model = engine  # DeepSpeedStrategy.deepspeed_engine is its model
    assert contract.step_grad_norm() is None
    engine.norm = 2.5
    assert contract.step_grad_norm().item() == 2.5
    engine.norm = float("nan")  # a norm the engine did compute, even NaN, is reported, not taken for "none"
    assert torch.isnan(contract.step_grad_norm())


class _ReduceAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        contract = contract_of(trainer)
        rank = trainer.global_rank
        self.results = {
            op: contract.reduce_across_ranks(torch.tensor([rank + 1.0, 10.0 * (rank + 1)]), op).tolist()
            for op in ("sum", "mean", "max")
        }
        self.members = (contract.grad_norm_ready, contract.can_skip_optimizer_step, contract.saves_to_urls)


def _reduce_under_ddp(world_size: int) -> dict:
    probe = _ReduceAtStart()
    trainer = cpu_trainer(
        devices=world_size,
        strategy="ddp",
        max_steps=1,
        callbacks=[probe],
        limit_val_batches=0,
    )
    trainer.fit(make_model("reference"), data(2))
    return {"results": probe.results, "members": probe.members}


@pytest.mark.distributed
def test_reduce_across_ranks_under_lightnings_ddp():
    results = run_distributed(_reduce_under_ddp, 2, 2, timeout=180)
    # Hand-computed over the ranks' [rank + 1, 10 (rank + 1)]: [1, 10] and [2, 20].
    for result in results:
        assert result["results"] == {"sum": [3.0, 30.0], "mean": [1.5, 15.0], "max": [2.0, 20.0]}
        assert result["members"] == ("before_optimizer_step", True, True)
