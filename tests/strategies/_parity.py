"""Shared pieces of the strategy parity tests: models, a loss recorder and one training run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import cpu_trainer
from lightning_llm.testing.models import HFCausalLM, UserLM

STEPS = 10
GLOBAL_BATCH = 8


def make_model(arch: str, layers: int = 2) -> L.LightningModule:
    torch.manual_seed(0)
    if arch == "reference":
        module = CausalLM(LlamaConfig.from_name("tiny", n_layers=layers), warmup_steps=2, max_steps=STEPS)
        module.configure_model()  # built now, from this seed, rather than inside fit()
        return module
    if arch == "reference_moe":  # every block's MLP 4 experts (top 2) beside a shared expert
        module = CausalLM(LlamaConfig.from_name("tiny-moe", n_layers=layers), warmup_steps=2, max_steps=STEPS)
        module.configure_model()
        return module
    if arch == "hf_llama":
        return HFCausalLM("llama", layers=layers)
    if arch == "hf_gpt2":
        return HFCausalLM("gpt2", layers=layers)
    if arch == "user":
        return UserLM(layers=layers)
    raise ValueError(arch)


class GlobalLoss(L.Callback):
    """Records each step's loss averaged over all ranks: the loss of the global batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(loss.item())


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded; under pipeline parallelism merged from all stages."""
    if not dist.is_initialized():
        return {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().clone().float() for k, v in state.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    return {k: v for part in gathered for k, v in part.items()}


def fit_recorded(module, dataloader, *, strategy="auto", devices: int = 1, ckpt_path=None, **limits):
    """Fit ``module`` on the CPU without logger, checkpoints or progress bar (``limits``: ``max_steps=``,
    ``max_epochs=``); the trainer and (each step's loss of the global batch, every parameter unsharded)."""
    losses = GlobalLoss()
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy,
        callbacks=[losses],
        **limits,
    )
    trainer.fit(module, dataloader, ckpt_path=ckpt_path)
    return trainer, (losses.losses, full_state(module))


def data(per_rank_batch: int) -> LLMDataModule:
    return LLMDataModule(num_tokens=20_000, seq_len=32, batch_size=per_rank_batch, seed=3)


def train(
    arch: str,
    strategy=None,
    devices: int = 1,
    dp: int = 1,
    clip: float | None = 0.5,
    accumulate: int = 1,
    steps: int = STEPS,
    save_to=None,
    resume_from=None,
    layers: int = 2,
    precision: str = "32-true",
    model=None,
    datamodule=None,
    plugins=None,
    callbacks=(),
):
    """Train until optimizer step ``steps``; return (global losses, full final parameters).

    ``model`` replaces the freshly seeded ``make_model(arch, layers)`` (e.g. one already converted to fp8);
    ``datamodule`` replaces the default data (then ``dp`` and ``accumulate`` do not size the batches).

    ``save_to`` writes a checkpoint at the last step from inside the loop, as a periodic save in a long
    run would (a save after ``fit`` returns marks the epoch finished); ``resume_from`` continues from one.
    """
    model = make_model(arch, layers) if model is None else model
    callbacks = [GlobalLoss(), *callbacks]
    if save_to is not None:
        save_to = Path(save_to)
        callbacks.append(
            ModelCheckpoint(
                dirpath=save_to.parent,
                filename=save_to.stem,
                every_n_train_steps=steps,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy or "auto",
        max_steps=steps,
        gradient_clip_val=clip,
        accumulate_grad_batches=accumulate,
        precision=None if plugins else precision,
        plugins=plugins,
        logger=False,
        enable_checkpointing=save_to is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule or data(GLOBAL_BATCH // dp // accumulate), ckpt_path=resume_from)
    return callbacks[0].losses, full_state(model)


def train_layouts(arch: str, layouts: list[dict], world_size: int, **kwargs) -> list:
    """Run each layout in turn on this rank (one process group serves them all)."""
    from lightning_llm.strategies import LLMParallelStrategy

    results = []
    for layout in layouts:
        dp = world_size // layout.get("tensor_parallel_size", 1) // layout.get("pipeline_parallel_size", 1)
        results.append(train(arch, LLMParallelStrategy(**layout), devices=world_size, dp=dp, **kwargs))
    return results if dist.get_rank() == 0 else None


def assert_parity(got, want, label: str, rtol: float = 1e-5, loss_rtol: float | None = None) -> None:
    """Per-step losses within ``rtol`` relative; each parameter tensor within ``rtol`` relative error
    (||p - p_ref|| / ||p_ref||), so sparse rounding noise in a near-zero element cannot decide it."""
    (losses, params), (ref_losses, ref_params) = got, want
    assert len(losses) == len(ref_losses)
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=loss_rtol or rtol,
        atol=0,
        msg=lambda m: f"{label} losses: {m}",
    )
    assert params.keys() == ref_params.keys(), f"{label}: {sorted(set(params) ^ set(ref_params))}"
    for name, ref in ref_params.items():
        error = (params[name] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert error <= rtol, f"{label} {name}: relative error {error:.2e} > {rtol:.0e}"
