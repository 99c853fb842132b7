"""Hugging Face weights in and out of lightning_llm's sharded models."""

from lightning_llm.hf.load import load_pretrained

__all__ = ["load_pretrained"]
