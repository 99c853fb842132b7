"""Tiny Hugging Face models (built in code, random init) for the tensor-parallel tests, and one training run."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_llm.testing import cpu_trainer
from lightning_llm.testing.models import _NextTokenModule
from tests.strategies._parity import GlobalLoss, data, full_state

GLOBAL_BATCH = 8
# Where a Hugging Face model's merged plan comes from: its own `_tp_plan` alone, or (transformers 5.17, whose plans
# leave the input embedding out) with inference filling the modules it does not name; the plans are the same.
HF_SOURCES = ("hugging face", "hugging face + inferred")


class TinyHF(_NextTokenModule):
    """An HF causal LM from a tiny config of family ``arch``, called the ordinary way (``model(input_ids)``)."""

    def __init__(self, arch: str, kv_heads: int = 2, heads: int = 4) -> None:
        super().__init__(learning_rate=0.5)
        import transformers as T

        common = {
            "vocab_size": 256,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "max_position_embeddings": 128,
        }
        if arch == "qwen3":
            config = T.Qwen3Config(**common, num_key_value_heads=kv_heads, head_dim=8)
            self.model = T.Qwen3ForCausalLM(config)
        elif arch == "gemma3":
            config = T.Gemma3TextConfig(
                **common, num_key_value_heads=kv_heads, head_dim=8, sliding_window=16, tie_word_embeddings=True
            )
            self.model = T.Gemma3ForCausalLM(config)
        elif arch == "olmo2":
            config = T.Olmo2Config(**common, num_key_value_heads=kv_heads)
            self.model = T.Olmo2ForCausalLM(config)
        elif arch == "gpt_neox":
            config = T.GPTNeoXConfig(**common, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
            self.model = T.GPTNeoXForCausalLM(config)
        elif arch == "mixtral":
            config = T.MixtralConfig(**common, num_key_value_heads=kv_heads, num_local_experts=4, num_experts_per_tok=2)
            self.model = T.MixtralForCausalLM(config)
        elif arch == "llama":
            config = T.LlamaConfig(**common, num_key_value_heads=kv_heads)
            self.model = T.LlamaForCausalLM(config)
        else:
            raise ValueError(arch)
        config._attn_implementation = "sdpa"

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


def replicated_copies(model) -> dict[str, torch.Tensor]:
    """This rank's copy of every parameter that is whole on each TP rank (plain tensors and Replicate DTensors)."""
    copies = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            if all(p.is_replicate() for p in param.placements):
                copies[name] = param.to_local().detach().clone()
        else:
            copies[name] = param.detach().clone()
    return copies


def train_tiny(arch: str, strategy=None, devices: int = 1, steps: int = 10, clip: float | None = 0.5):
    """(global losses, full final parameters, this rank's replicated copies)."""
    torch.manual_seed(0)
    model = TinyHF(arch)
    recorder = GlobalLoss()
    trainer = cpu_trainer(
        devices=devices,
        strategy=strategy or "auto",
        max_steps=steps,
        gradient_clip_val=clip,
        callbacks=[recorder],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data(GLOBAL_BATCH))  # tp only: every rank reads the whole batch
    return recorder.losses, full_state(model), replicated_copies(model)


def train_tiny_layouts(cases: list[tuple[str, dict, int]], world_size: int) -> list:
    """Each (arch, strategy kwargs, steps) in turn in one process group; rank 0 returns full results."""
    from lightning_llm.strategies import LLMParallelStrategy

    results = []
    for arch, layout, steps in cases:
        losses, params, copies = train_tiny(arch, LLMParallelStrategy(**layout), devices=world_size, steps=steps)
        results.append((losses, params if dist.get_rank() == 0 else None, copies))
    return results
