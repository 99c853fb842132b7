"""Data: the embedded synthetic corpus, text files and memory-mapped token files."""

from lightning_llm.data.datamodule import LLMDataModule
from lightning_llm.data.datasets import TokenWindows, read_token_file
from lightning_llm.data.sampler import ResumableDistributedSampler
from lightning_llm.data.synthetic import entropy_floor, markov_corpus
from lightning_llm.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer", "LLMDataModule", "ResumableDistributedSampler", "TokenWindows", "entropy_floor",
    "markov_corpus", "read_token_file",
]
