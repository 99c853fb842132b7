"""The optimizer paths a GPU takes that the CPU suite takes only in part, each against its unfused or torch oracle.

* fp16 with a loss scaler, gradient clipping and fused AdamW (what ``CausalLM`` picks on CUDA) under
  ``LLMParallelStrategy``: the strategy's precision plugin unscales a fused optimizer's gradients right after backward
  so that clipping works (Lightning alone refuses it). Oracle: the same run with the unfused for-loop AdamW, which
  Lightning unscales itself: per-step losses, loss scales (skipped steps included) and parameters within fp16
  tolerance.
* ``ShardedMuon`` on one process against ``torch.optim.Muon`` and AdamW: the same updates (in bf16 Newton-Schulz on
  both sides, so within bf16 rounding; the CPU suite asserts bit equality on the CPU).

Each runs on the CPU everywhere and on CUDA where a device exists (those cases marked ``gpu``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.optim import ShardedMuon, muon_param_groups
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed
from tests.optim.test_sharded_muon import Tiny

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, CUDA])]
STEPS = 6
INIT_SCALE = 2.0**24  # overflows in the first steps: the skipped steps must be the same with and without fusion


class AdamWChoice(CausalLM):
    """The reference model with its AdamW fused or the for-loop one, on any device (CausalLM fuses on CUDA only)."""

    def __init__(self, fused: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fused = fused

    def configure_optimizers(self):
        config = super().configure_optimizers()
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in config["optimizer"].param_groups]
        kind = {"fused": True} if self.fused else {"foreach": False, "fused": False}
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas), **kind)
        schedule = config["lr_scheduler"]["scheduler"].lr_lambdas[0]
        config["optimizer"] = optimizer
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return config


class _Record(L.Callback):
    def __init__(self) -> None:
        self.losses, self.scales = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _fp16_run(device: str, fused: bool):
    torch.manual_seed(0)
    module = AdamWChoice(fused, config=LlamaConfig.from_name("tiny"), warmup_steps=2, max_steps=STEPS)
    record = _Record()
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        strategy=LLMParallelStrategy(),
        plugins=[MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, init_scale=INIT_SCALE))],
        gradient_clip_val=0.5,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record],
    )
    trainer.fit(module, LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=4, seed=3))
    assert trainer.optimizers[0].defaults["fused"] is fused
    params = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
    return record.losses, record.scales, params


def _fused_and_unfused(device: str):
    return _fp16_run(device, fused=True), _fp16_run(device, fused=False)


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
def test_fp16_scaler_with_clipping_and_fused_adamw_steps_like_the_unfused_one(device):
    ((fused, unfused),) = run_distributed(_fused_and_unfused, 1, device, timeout=500)
    (losses, scales, params), (ref_losses, ref_scales, ref_params) = fused, unfused
    assert scales == ref_scales and min(scales) < INIT_SCALE, (scales, ref_scales)  # overflows skipped alike
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    for name, ref in ref_params.items():
        assert (params[name] - ref).norm() <= 5e-3 * ref.norm(), name


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs a newer torch")
@pytest.mark.parametrize("device", DEVICES)
def test_sharded_muon_updates_like_torch_muon_and_adamw(device):
    torch.manual_seed(0)
    model, reference = Tiny().to(device), Tiny().to(device)
    reference.load_state_dict(model.state_dict())
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mine = ShardedMuon(muon_param_groups(model, adamw_lr=1e-2, betas=(0.9, 0.95)), lr=0.02, weight_decay=0.1)
    theirs = [
        torch.optim.Muon([reference.hidden.weight], lr=0.02, weight_decay=0.1),
        torch.optim.AdamW(
            [reference.embed.weight, reference.hidden.bias, reference.out.weight],
            lr=1e-2,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            foreach=False,
        ),
    ]
    ids = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(2)).to(device)
    for _ in range(4):
        for net in (model, reference):
            net(ids).logsumexp(-1).mean().backward()
        for optimizer in (mine, *theirs):
            optimizer.step()
            optimizer.zero_grad()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        update, ref_update = got - start[name], want - start[name]
        assert (update - ref_update).norm() <= 1e-2 * ref_update.norm(), name
