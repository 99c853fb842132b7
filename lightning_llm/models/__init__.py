"""Reference decoder-only LLM (Llama-style) and its LightningModule."""

from lightning_llm.models.cross_entropy import head_cross_entropy, linear_cross_entropy
from lightning_llm.models.llama import PRESETS, Llama, LlamaConfig
from lightning_llm.models.module import CausalLM

__all__ = ["PRESETS", "CausalLM", "Llama", "LlamaConfig", "head_cross_entropy", "linear_cross_entropy"]
