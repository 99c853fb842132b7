"""fp16 with a loss scaler trains under every layout as one process does (issue: the recipe under every layout).

One process runs Lightning's own ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))``:
autocast to float16, the loss scaled before backward, gradients unscaled and checked for inf/NaN before clipping,
a step skipped and the scale halved on overflow. Each layout gets the same plugin; its per-step losses, every
parameter and the scale after every step must match. Before the fix, pp2's schedule ran backward on the unscaled
loss (losses 1.7% off, a different final scale: it never saw the overflow one process sees) and tp2 crashed in
``_amp_foreach_non_finite_check_and_unscale_`` on mixed plain and DTensor gradients.

``init_scale=2**24`` forces overflows in the first steps (fp16's largest value is 65504): one process skips them,
and so must every rank of every layout at the same steps, whichever rank's shard or stage overflowed.

Every run computes its loss from whole logits (``fused_cross_entropy=False``): tensor parallelism always does (its
head is split over the vocabulary), and the chunked loss holds the head's gradients in fp32 where the logits path
overflows in fp16, so the two would skip different steps by design, not by a fault of either layout.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.models.module import warmup_cosine
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.strategies._parity import STEPS, assert_parity, make_model, train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# fp16 rounds the forward's matmuls: layouts that split or reorder them differ from one process by rounding only.
LOSS_RTOL, PARAM_RTOL = 2e-3, 5e-3
INIT_SCALE = 2.0**24  # overflows at first, so skipped steps and halvings are part of what must match
# Each layout against the run that does the same arithmetic in one process or in Lightning's own DDP: a data-parallel
# rank's loss is the mean over its half of the batch (its activation gradients are twice one process's, so fp16
# overflows at a different scale, exactly as under DDP), and a pipeline's micro-batch is one of
# accumulate_grad_batches=4 micro-batches of one process.
LAYOUTS = {
    "tp2": ({"tensor_parallel_size": 2}, "single"),
    "tp2-sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, "single"),
    "zero3": ({"zero_stage": 3}, "ddp"),
    "pp2-1f1b": ({"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "num_microbatches": 4}, "accumulate4"),
    "pp2-interleaved1f1b": (
        {
            "pipeline_parallel_size": 2,
            "pipeline_schedule": "Interleaved1F1B",
            "num_microbatches": 4,
            "virtual_stages": 2,
        },
        "accumulate4",
    ),
}


class ScaleHistory(L.Callback):
    """The loss scale after every training batch (it halves on a skipped step and grows after clean ones)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _fp16():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))


def _run(strategy=None, devices=1, dp=1, accumulate=1, model=None):
    history = ScaleHistory()
    if model is None:
        model = make_model("reference", layers=4)
        model.fused_cross_entropy = False
    losses, params = train(
        "reference",
        strategy,
        model=model,
        devices=devices,
        dp=dp,
        layers=4,
        plugins=[_fp16()],
        callbacks=[history],
        clip=0.5,
        accumulate=accumulate,
    )
    return losses, params, history.scales[accumulate - 1 :: accumulate]  # the scale after each optimizer step


def _layouts(world_size):
    results = {"ddp": _run("ddp", devices=world_size, dp=world_size)}
    for label, (layout, _) in LAYOUTS.items():
        dp = world_size // layout.get("tensor_parallel_size", 1) // layout.get("pipeline_parallel_size", 1)
        results[label] = _run(LLMParallelStrategy(**layout), devices=world_size, dp=dp)
    return results


def test_fp16_with_a_loss_scaler_matches_the_same_arithmetic_under_every_layout():
    oracles = {"single": _run(), "accumulate4": _run(accumulate=4)}
    assert oracles["single"][2][0] < INIT_SCALE, "the forced overflow did not happen: the test would prove nothing"
    per_rank = run_distributed(_layouts, 2, 2, timeout=560)
    oracles["ddp"] = per_rank[0]["ddp"]
    for label, (_, oracle) in LAYOUTS.items():
        losses, params, scales = per_rank[0][label]
        want_losses, want_params, want_scales = oracles[oracle]
        assert scales == want_scales, f"{label}: loss scale per step {scales} vs {oracle} {want_scales}"
        assert per_rank[1][label][2] == scales, f"{label}: the ranks' loss scales differ (a step skipped on one only)"
        if oracle == "accumulate4":  # one process logs a loss per micro-batch: compare the parameters
            want_losses = losses
        assert_parity(
            (losses, params), (want_losses, want_params), f"fp16 {label}", rtol=PARAM_RTOL, loss_rtol=LOSS_RTOL
        )


def _pp2_tp2(world_size):
    layout = {
        "pipeline_parallel_size": 2,
        "tensor_parallel_size": 2,
        "pipeline_schedule": "1F1B",
        "num_microbatches": 4,
    }
    return _run(LLMParallelStrategy(**layout), devices=world_size, dp=1)


def test_fp16_with_a_loss_scaler_under_pp2_x_tp2_matches_one_process_with_clipping():
    # 4 ranks: two pipeline stages, each split over two tensor-parallel ranks; the found-inf flag and the global norm
    # must agree over both mesh dimensions. The oracle is one process accumulating the 4 micro-batches.
    _, want_params, want_scales = _run(accumulate=4)  # one process logs a loss per micro-batch: parameters compared
    assert want_scales[0] < INIT_SCALE, "the forced overflow did not happen: the test would prove nothing"
    per_rank = run_distributed(_pp2_tp2, 4, 4, timeout=560)
    losses, params, scales = per_rank[0]
    assert scales == want_scales, f"pp2 x tp2: loss scale per step {scales} vs one process {want_scales}"
    assert all(rank[2] == scales for rank in per_rank), "the ranks' loss scales differ (a step skipped on some only)"
    assert_parity((losses, params), (losses, want_params), "fp16 pp2 x tp2", rtol=PARAM_RTOL, loss_rtol=LOSS_RTOL)


class _AdamWChoice(CausalLM):
    """The reference model (as ``train`` builds it) with its AdamW fused or not."""

    def __init__(self, fused: bool) -> None:
        torch.manual_seed(0)
        super().__init__(
            LlamaConfig.from_name("tiny", n_layers=4), warmup_steps=2, max_steps=STEPS, fused_cross_entropy=False
        )
        self.fused = fused
        self.configure_model()

    def configure_optimizers(self):
        config = super().configure_optimizers()
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in config["optimizer"].param_groups]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=self.hparams.betas, fused=self.fused)
        schedule = warmup_cosine(self.hparams.warmup_steps, STEPS, self.hparams.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fused_layouts(world_size):
    return {
        label: _run(LLMParallelStrategy(**layout), devices=world_size, dp=dp, model=_AdamWChoice(fused=True))
        for label, layout, dp in (("zero3", {"zero_stage": 3}, 2), ("tp2", {"tensor_parallel_size": 2}, 1))
    }


def test_fused_adamw_with_clipping_under_fp16_matches_the_unfused_oracles():
    # Lightning refuses clipping with a fused optimizer under fp16 (it leaves the gradients scaled for the fused
    # step); the strategy unscales them after backward like any other's. Oracles: one process and Lightning's DDP,
    # each with the unfused AdamW Lightning supports there.
    oracles = {"tp2": _run(model=_AdamWChoice(fused=False))}
    per_rank = run_distributed(_fused_layouts, 2, 2, timeout=560)
    oracles["zero3"] = run_distributed(_ddp_unfused, 2, 2, timeout=560)[0]
    for label, (losses, params, scales) in per_rank[0].items():
        assert scales == oracles[label][2], f"fused {label}: loss scale per step {scales} vs {oracles[label][2]}"
        assert per_rank[1][label][2] == scales, f"fused {label}: the ranks' loss scales differ"
        assert_parity((losses, params), oracles[label][:2], f"fp16 fused {label}", rtol=PARAM_RTOL, loss_rtol=LOSS_RTOL)


def _ddp_unfused(world_size):
    return _run("ddp", devices=world_size, dp=world_size, model=_AdamWChoice(fused=False))
