"""Reference decoder-only LLM (Llama-style) and its LightningModule."""

from lightning_llm.models.cross_entropy import head_cross_entropy, linear_cross_entropy
from lightning_llm.models.llama import Llama, LlamaConfig
from lightning_llm.models.module import CausalLM
from lightning_llm.models.presets import PRESETS

__all__ = ["PRESETS", "CausalLM", "Llama", "LlamaConfig", "head_cross_entropy", "linear_cross_entropy"]
