"""GradNormMonitor reports the single-process gradient norm under every parallel layout."""

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import GradNormMonitor
from lightning_llm.testing import run_distributed
from tests.strategies._parity import data, make_model

pytestmark = pytest.mark.distributed


def _first_norms(strategy="auto", devices=1, dp=1, arch="hf_gpt2", clip=None):
    monitor = GradNormMonitor(per_block=True)
    model = make_model(arch, layers=4)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor], limit_val_batches=0, gradient_clip_val=clip)
    trainer.fit(model, data(8 // dp))
    metrics = trainer.callback_metrics
    return {k: metrics[k].item() for k in metrics if k.startswith("grad_norm/")}


def _layouts(world_size):
    from lightning_llm.strategies import LLMParallelStrategy

    return {
        "dp2 (ddp)": _first_norms("ddp", world_size, dp=2),
        "dp2 zero3": _first_norms(LLMParallelStrategy(zero_stage=3), world_size, dp=2),
        "tp2": _first_norms(LLMParallelStrategy(tensor_parallel_size=2), world_size, arch="hf_llama"),
        "pp2 (tied embedding on both stages)": _first_norms(
            LLMParallelStrategy(pipeline_parallel_size=2, num_microbatches=2), world_size),
    }


def test_norm_equals_single_process_under_every_layout():
    results = run_distributed(_layouts, 2, 2, timeout=300)[0]
    for label, norms in results.items():
        arch = "hf_llama" if label == "tp2" else "hf_gpt2"
        want = _first_norms(arch=arch)
        assert norms.keys() == want.keys(), label
        for key, value in want.items():
            assert norms[key] == pytest.approx(value, rel=1e-5), f"{label} {key}"
        blocks = sum(v**2 for k, v in want.items() if "block_" in k)
        assert blocks < want["grad_norm/total"] ** 2


def test_clipped_flag_and_arguments():
    norms = _first_norms(arch="reference", clip=1e-3)
    assert norms["grad_norm/clipped"] == 1.0
    assert _first_norms(arch="reference", clip=1e3)["grad_norm/clipped"] == 0.0
    with pytest.raises(ValueError, match="norm_type=0"):
        GradNormMonitor(norm_type=0)


def _deepspeed_norm(world_size):
    from lightning_llm.strategies import LLMDeepSpeedStrategy

    return _first_norms(LLMDeepSpeedStrategy(zero_stage=2), world_size, dp=2, arch="reference", clip=1e3)


def test_norm_under_deepspeed_zero2_equals_single_process():
    norms = run_distributed(_deepspeed_norm, 2, 2, timeout=240)[0]
    want = _first_norms(arch="reference", clip=1e3)
    assert norms["grad_norm/total"] == pytest.approx(want["grad_norm/total"], rel=1e-5)
