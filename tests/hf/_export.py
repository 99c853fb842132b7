"""Rank-side pieces of the export tests: train a tiny model a few steps in a layout, save it with Lightning,
and return what the trained model computes (its logits in the layout where a plain forward runs, its full
parameters always)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM, LlamaConfig
from lightning_llm.testing import cpu_trainer
from tests.hf._pretrained import PretrainedLM
from tests.strategies._parity import full_state

STEPS = 3
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(11))
LAYOUTS = {
    "zero3_dp2": {"zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "num_microbatches": 2},
    "ep2": {"expert_parallel_size": 2, "zero_stage": 3},  # each rank holds half the experts of every layer
}
# (arch, layout, single file?): every layout for the HF models, the reference model once, one single-file save.
CASES = [(arch, layout, False) for arch in ("llama", "qwen2") for layout in ("zero3_dp2", "tp2", "pp2")]
CASES += [("reference", "tp2", False), ("llama", "zero3_dp2", True), ("qwen3_moe", "ep2", False)]


def make_module(arch: str) -> L.LightningModule:
    """Tiny model from a fixed seed: HF Llama (untied), HF Qwen2 (tied embeddings), HF Qwen3-MoE or the reference
    CausalLM."""
    torch.manual_seed(0)
    if arch == "reference":
        module = CausalLM(
            LlamaConfig.from_name("tiny", tie_embeddings=True), learning_rate=1e-2, warmup_steps=1, max_steps=STEPS
        )
        module.configure_model()
        return module
    module = PretrainedLM(arch)
    module.configure_model()
    if arch == "qwen2":
        module.model.config.tie_word_embeddings = True
        module.model.lm_head.weight = module.model.model.embed_tokens.weight
    return module


def logits_of(module: L.LightningModule, tokens: torch.Tensor) -> torch.Tensor:
    """The module's logits for ``tokens`` (a DTensor output is gathered)."""
    with torch.no_grad():
        out = module.logits(tokens) if hasattr(module, "logits") else module(tokens)
    return (out.full_tensor() if isinstance(out, DTensor) else out).float()


def _train_and_save(arch: str, layout: str, single_file: bool, root: Path) -> dict:
    from lightning_llm.strategies import LLMParallelStrategy

    module = make_module(arch)
    strategy = LLMParallelStrategy(save_distributed_checkpoint=not single_file, **LAYOUTS[layout])
    dp = 1 if layout in ("tp2", "pp2") else 2
    trainer = cpu_trainer(
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, LLMDataModule(num_tokens=5_000, seq_len=24, batch_size=4 // dp, seed=3))
    path = root / f"{arch}-{layout}{'.ckpt' if single_file else ''}"
    trainer.save_checkpoint(path)
    # A pipeline stage cannot run the whole forward outside its schedule; its full parameters are the oracle there.
    logits = None if layout == "pp2" else logits_of(module, TOKENS)
    return {"path": str(path), "logits": logits, "state": full_state(module)}


def _load_reference(hf_dir: str, layout: str) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama directory loaded by the strategy into the sharded reference CausalLM; full parameters."""
    import transformers

    from lightning_llm.hf.llama_map import from_hf_config
    from lightning_llm.strategies import LLMParallelStrategy

    module = CausalLM(from_hf_config(transformers.AutoConfig.from_pretrained(hf_dir)))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=LLMParallelStrategy(load_pretrained=hf_dir, **LAYOUTS[layout]),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
    )
    trainer.validate(module, LLMDataModule(num_tokens=5_000, seq_len=24, batch_size=2, seed=3), verbose=False)
    return full_state(module)


def train_and_save_all(root: str, hf_llama_dir: str) -> dict | None:
    """Every case of :data:`CASES` on this rank, one process group for all, and ``hf_llama_dir`` loaded into the
    reference model under dp2 ZeRO-3 and tp2; rank 0 returns the results."""
    results = {case: _train_and_save(*case, Path(root)) for case in CASES}
    results.update(
        {("load_reference", layout): _load_reference(hf_llama_dir, layout) for layout in ("zero3_dp2", "tp2")}
    )
    return results if dist.get_rank() == 0 else None
