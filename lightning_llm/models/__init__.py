"""Reference decoder-only LLM (Llama-style) and its LightningModule."""

from lightning_llm.models.llama import PRESETS, Llama, LlamaConfig
from lightning_llm.models.module import CausalLM

__all__ = ["PRESETS", "CausalLM", "Llama", "LlamaConfig"]
