"""Hugging Face weights in and out of lightning_llm's sharded models."""

from lightning_llm.hf.export import export_hf
from lightning_llm.hf.load import load_pretrained

__all__ = ["export_hf", "load_pretrained"]
