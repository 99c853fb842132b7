import types

import pytest
import torch

from lightning_llm.callbacks import MFUMonitor
from lightning_llm.data import LLMDataModule
from lightning_llm.data.batch import batch_tokens
from lightning_llm.modeling.shape import ModelShape
from lightning_llm.models import CausalLM, Llama, LlamaConfig
from lightning_llm.testing import cpu_trainer, run_distributed

BATCH, SEQ = 4, 32


class FakeClock:
    """perf_counter that advances one second per call: every logging window lasts exactly one second."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def _fit(strategy="auto", devices=1, steps=4, **monitor):
    import lightning_llm.callbacks.mfu as mfu

    real_time, mfu.time = mfu.time, types.SimpleNamespace(perf_counter=FakeClock().perf_counter)
    try:
        return _fit_with_clock(strategy, devices, steps, **monitor)
    finally:
        mfu.time = real_time


def _trainer(callback, strategy="auto", devices=1, steps=4):
    torch.manual_seed(0)
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[callback],
        limit_val_batches=0,
    )
    trainer.fit(CausalLM("tiny"), LLMDataModule(num_tokens=20_000, seq_len=SEQ, batch_size=BATCH))
    return trainer


def _fit_with_clock(strategy, devices, steps, **monitor):
    trainer = _trainer(MFUMonitor(**{"log_every_n_steps": 2, "peak_flops": 1e12, **monitor}), strategy, devices, steps)
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    model = trainer.lightning_module
    return metrics, ModelShape.of(model).flops_per_token(SEQ) if devices == 1 else None


def test_mfu_and_tflops_match_hand_computed_values():
    metrics, _ = _fit()
    # The tiny reference model: 2 blocks, attention width 64; N counted by the model itself.
    n = Llama(LlamaConfig.from_name("tiny")).num_parameters(exclude_embeddings=True)
    flops_per_token = 6 * n + 12 * 2 * 64 * SEQ
    tokens_per_sec = 2 * BATCH * SEQ / 1.0  # 2 steps per one-second window
    assert metrics["train/items_per_sec"] == pytest.approx(tokens_per_sec)
    assert metrics["train/samples_per_sec"] == pytest.approx(2 * BATCH)
    assert metrics["train/device/flops_per_sec"] == pytest.approx(tokens_per_sec * flops_per_token)
    assert metrics["train/flops_per_sec"] == pytest.approx(tokens_per_sec * flops_per_token)  # one device
    assert metrics["train/device/mfu"] == pytest.approx(tokens_per_sec * flops_per_token / 1e12)
    assert "train/device/hfu" not in metrics


def test_peak_comes_from_the_device_lookup(monkeypatch):
    import lightning_llm.callbacks.mfu as mfu

    asked = []
    monkeypatch.setattr(mfu, "device_peak_flops", lambda device, precision: asked.append((device, precision)) or 4e12)
    metrics, _ = _fit(peak_flops=None)
    assert asked == [(torch.device("cpu"), "32-true")]
    assert metrics["train/device/mfu"] == pytest.approx(metrics["train/device/flops_per_sec"] / 4e12)


def test_progress_bar_shows_tokens_per_sec_and_mfu_only_when_asked():
    import lightning_llm.callbacks.mfu as mfu

    shown = {}
    for prog_bar in (True, False):
        real_time, mfu.time = mfu.time, types.SimpleNamespace(perf_counter=FakeClock().perf_counter)
        try:
            trainer = _trainer(MFUMonitor(log_every_n_steps=2, peak_flops=1e12, prog_bar=prog_bar))
        finally:
            mfu.time = real_time
        shown[prog_bar] = set(trainer.progress_bar_metrics) & {
            "tok/s",
            "mfu",
            "train/items_per_sec",
            "train/device/mfu",
        }
        logged = set(trainer.callback_metrics)
    assert shown == {True: {"tok/s", "mfu"}, False: set()}  # short names, only when asked
    assert {"train/items_per_sec", "train/device/mfu"} <= logged


def _layout_metrics(world_size):
    from lightning_llm.strategies import LLMParallelStrategy

    dp2 = _fit(LLMParallelStrategy(zero_stage=3), devices=world_size)[0]
    tp2 = _fit(LLMParallelStrategy(tensor_parallel_size=2), devices=world_size)[0]
    full_ac = _fit(LLMParallelStrategy(zero_stage=3, activation_checkpointing="full"), devices=world_size)[0]
    return dp2, tp2, full_ac


@pytest.mark.distributed
def test_tokens_count_once_per_data_parallel_replica():
    dp2, tp2, full_ac = run_distributed(_layout_metrics, 2, 2, timeout=240)[0]
    assert dp2["train/items_per_sec"] == pytest.approx(2 * 2 * BATCH * SEQ)  # two replicas
    assert tp2["train/items_per_sec"] == pytest.approx(2 * BATCH * SEQ)  # one replica on two ranks
    # Per device: the same model FLOPs spread over twice the devices for tp2 as for one replica.
    assert tp2["train/device/flops_per_sec"] == pytest.approx(dp2["train/device/flops_per_sec"] / 2)
    assert tp2["train/flops_per_sec"] == pytest.approx(dp2["train/flops_per_sec"] / 2)
    # Full recomputation adds one forward of each block: hardware FLOPs exceed model FLOPs.
    assert full_ac["train/device/hfu"] > full_ac["train/device/mfu"] == pytest.approx(dp2["train/device/mfu"])


def test_batch_tokens_and_argument_checks():
    assert batch_tokens(torch.zeros(4, 33), shifted_targets=True) == (4, 128)
    assert batch_tokens({"input_ids": torch.zeros(2, 10)}, shifted_targets=False) == (2, 20)
    with pytest.raises(ValueError, match="log_every_n_steps=0 must be an integer >= 1"):
        MFUMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="peak_flops=-1"):
        MFUMonitor(peak_flops=-1)
