"""The strategy contract: both strategies implement it, and every callback works under Lightning's own strategies."""

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import CheckpointRotation, GradNormMonitor, MFUMonitor
from lightning_llm.checkpointing.files import complete_checkpoints, read_marker
from lightning_llm.contract import ParallelLayout, contract_of, implements_contract
from lightning_llm.contract.lightning import LightningContract
from lightning_llm.strategies import LLMDeepSpeedStrategy, LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests._optional import HAS_DEEPSPEED
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
        "samples_per_sec": metrics["throughput/samples_per_sec"].item(),
        "tokens_per_sec": metrics["throughput/tokens_per_sec"].item(),
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
