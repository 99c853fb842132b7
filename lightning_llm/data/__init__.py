"""Data: the embedded synthetic corpus, text files, token files from ``lightning-llm prepare``, packing.

The tokenizing step itself is :func:`lightning_llm.data.prepare.prepare` (``lightning-llm prepare``).
"""

from lightning_llm.data.datamodule import LLMDataModule
from lightning_llm.data.datasets import TokenWindows, read_token_file
from lightning_llm.data.packing import PackedDocuments, document_causal_mask
from lightning_llm.data.sampler import ResumableDistributedSampler
from lightning_llm.data.synthetic import entropy_floor, markov_corpus
from lightning_llm.data.token_files import TokenFileInfo, read_offsets, read_token_info, token_dtype_for
from lightning_llm.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "LLMDataModule",
    "PackedDocuments",
    "ResumableDistributedSampler",
    "TokenFileInfo",
    "TokenWindows",
    "document_causal_mask",
    "entropy_floor",
    "markov_corpus",
    "read_offsets",
    "read_token_file",
    "read_token_info",
    "token_dtype_for",
]
