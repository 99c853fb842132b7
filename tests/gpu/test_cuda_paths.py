"""The CUDA paths that CPU runs cannot reach: bf16 on one GPU, compile, fused AdamW, checkpoints, MFU.

Marked ``gpu``; skipped where no CUDA device exists (a hardware condition). Run on a GPU machine with
``pytest -m gpu`` (``benchmarks/gpu_suite.sh`` does). Models are tiny: these check correctness, the
benchmarks measure speed.
"""

import time

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import MFUMonitor, MoEMonitor
from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.strategies import LLMParallelStrategy
from lightning_llm.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
STEPS = 5


def _model(layers: int = 2, **config) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("tiny", n_layers=layers, **config), warmup_steps=2, max_steps=STEPS)
    module.configure_model()
    return module


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def _fit(
    module, strategy="auto", precision="32-true", steps=STEPS, callbacks=(), ckpt_path=None, enable_checkpointing=False
):
    losses = _Losses()
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=enable_checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[losses, *callbacks],
    )
    trainer.fit(module, LLMDataModule(num_tokens=50_000, seq_len=64, batch_size=8, seed=3), ckpt_path=ckpt_path)
    params = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
    return trainer, losses.losses, params


def _strategy_bf16():
    # ZeRO 3 at world size 1: the strategy's own path (no FSDP at one replica; Lightning's plugin autocasts).
    return _fit(_model(), LLMParallelStrategy(zero_stage=3), precision="bf16-mixed")[1:]


def test_bf16_mixed_on_one_gpu_matches_plain_lightning():
    ((losses, params),) = run_distributed(_strategy_bf16, 1, timeout=500)
    _, ref_losses, ref_params = _fit(_model(), precision="bf16-mixed")
    # Same autocast arithmetic on the same card: bf16 tolerance (u = 2^-8) is generous; kernels may differ.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    for name, ref in ref_params.items():
        assert (params[name] - ref).norm() <= 1e-2 * ref.norm(), name


def _compiled_and_eager():
    eager = _fit(_model(), LLMParallelStrategy())[1:]
    compiled = _fit(_model(), LLMParallelStrategy(compile_blocks=True))[1:]
    return eager, compiled


def test_compile_blocks_matches_eager_in_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    ((eager, compiled),) = run_distributed(_compiled_and_eager, 1, timeout=500)
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=1e-5, atol=0)
    for name, ref in eager[1].items():
        assert (compiled[1][name] - ref).norm() <= 1e-5 * ref.norm(), name


def test_adamw_is_fused_on_cuda_and_steps_like_the_unfused_one():
    trainer, _, _ = _fit(_model(), steps=1)
    optimizer = trainer.optimizers[0]
    assert optimizer.defaults["fused"] is True
    # Oracle: torch's for-loop AdamW on copies of the same parameters and gradients.
    params = [torch.randn(64, 64, device="cuda") for _ in range(3)]
    grads = [torch.randn_like(p) for p in params]
    fused, loop = [p.clone().requires_grad_() for p in params], [p.clone().requires_grad_() for p in params]
    for group, kwargs in ((fused, {"fused": True}), (loop, {"foreach": False})):
        opt = torch.optim.AdamW(group, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kwargs)
        for _ in range(3):
            for p, g in zip(group, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(fused, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _save_and_resume(root):
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(
        dirpath=root, filename="half", every_n_train_steps=2, save_top_k=-1, enable_version_counter=False
    )
    _, first, _ = _fit(_model(), LLMParallelStrategy(), steps=2, callbacks=[checkpoint], enable_checkpointing=True)
    _, second, params = _fit(_model(), LLMParallelStrategy(), steps=STEPS, ckpt_path=f"{root}/half.ckpt")
    return first + second, params


def test_checkpoint_save_and_resume_on_cuda(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    ((losses, params),) = run_distributed(_save_and_resume, 1, str(tmp_path), timeout=500)
    ((ref_losses, ref_params),) = run_distributed(_fit_uninterrupted, 1, timeout=500)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, ref in ref_params.items():
        assert (params[name] - ref).norm() <= 1e-5 * ref.norm(), name


def _fit_uninterrupted():
    return _fit(_model(), LLMParallelStrategy())[1:]


class _Window(L.Callback):
    """Wall time of steps 9..16, synchronised at both ends: the window MFUMonitor's second log covers."""

    def __init__(self) -> None:
        self.start = self.end = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step in (8, 16):
            torch.cuda.synchronize()
            setattr(self, "start" if trainer.global_step == 8 else "end", time.perf_counter())


def test_mfu_monitor_agrees_with_the_benchmark_arithmetic():
    from lightning_llm.modeling.shape import ModelShape

    peak, window = 100e12, _Window()
    torch.manual_seed(0)
    module = CausalLM(LlamaConfig.from_name("tiny", n_layers=4, dim=256, max_seq_len=64), warmup_steps=2, max_steps=16)
    module.configure_model()
    # MFUMonitor logs after steps 8 and 16; the second window (steps 9..16) is past compilation and warm-up.
    trainer, _, _ = _fit(
        module, steps=16, callbacks=[window, MFUMonitor(log_every_n_steps=8, peak_flops=peak)], precision="bf16-mixed"
    )
    tokens = 8 * 8 * 64  # 8 steps x batch 8 x 64 trained tokens per sample
    benchmark_mfu = tokens / (window.end - window.start) * ModelShape.of(module).flops_per_token(64) / peak
    assert trainer.callback_metrics["train/device/mfu"].item() == pytest.approx(benchmark_mfu, rel=0.05)


class _RecordedMoE(MoEMonitor):
    def __init__(self) -> None:
        super().__init__(log_every_n_steps=1)
        self.history = []

    def metrics(self, trainer):
        self.history.append(super().metrics(trainer))
        return self.history[-1]


MOE = {"n_experts": 4, "moe_hidden_dim": 64, "n_shared_experts": 1, "n_dense_layers": 1}


def _moe_runs():
    # The reference mixture of experts (stacked experts, top-2 router, a shared expert) on CUDA under the strategy.
    monitor = _RecordedMoE()
    ours = _fit(_model(layers=3, **MOE), LLMParallelStrategy(), precision="bf16-mixed", callbacks=[monitor])
    return ours[1:], monitor.history


def test_reference_moe_on_cuda_matches_plain_lightning_and_is_monitored():
    ((ours, history),) = run_distributed(_moe_runs, 1, timeout=500)
    _, ref_losses, ref_params = _fit(_model(layers=3, **MOE), precision="bf16-mixed")
    losses, params = ours
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0)
    for name, ref in ref_params.items():
        assert (params[name] - ref).norm() <= 1e-2 * ref.norm(), name
    # Every step logged; top 2 of 4 experts: the busiest takes between the mean and every token (load 1 to 2).
    assert len(history) == STEPS and all(1 <= h["moe/max_load"] <= 2 for h in history), history


def test_grouped_experts_match_the_loop_in_bf16_on_cuda():
    """The grouped-GEMM experts (the "auto" choice on CUDA in bf16) against the per-expert loop, both in bf16 on
    the GPU and against an fp32 loop: the same routes, outputs and gradients within bf16 rounding."""
    from lightning_llm.models.moe import Experts

    torch.manual_seed(0)
    loop = Experts(num_experts=8, dim=64, hidden_dim=128, implementation="loop").cuda()
    torch.nn.init.normal_(loop.gate_up_proj, std=0.1)
    torch.nn.init.normal_(loop.down_proj, std=0.1)
    grouped = Experts(num_experts=8, dim=64, hidden_dim=128, implementation="auto").cuda()
    grouped.load_state_dict(loop.state_dict())
    hidden = torch.randn(300, 64, device="cuda")
    ids = torch.randint(0, 7, (300, 2), device="cuda")  # expert 7 idle
    weights = torch.rand(300, 2, device="cuda")
    outs = {}
    for name, module, dtype in [
        ("fp32 loop", loop, torch.float32),
        ("bf16 loop", loop, torch.bfloat16),
        ("bf16 grouped", grouped, torch.bfloat16),
    ]:
        module = module.to(dtype)
        x = hidden.to(dtype).detach().requires_grad_()  # a leaf in every dtype: fp32's .to() is `hidden` itself
        out = module(x, ids, weights.to(dtype))
        out.float().square().sum().backward()
        outs[name] = (out.float(), x.grad.float(), module.gate_up_proj.grad.float())
        module.zero_grad()
    for got, want, bf16 in zip(outs["bf16 grouped"], outs["fp32 loop"], outs["bf16 loop"]):
        error, loop_error = (got - want).norm() / want.norm(), (bf16 - want).norm() / want.norm()
        assert error <= max(2 * loop_error, 1e-2), (error, loop_error)
