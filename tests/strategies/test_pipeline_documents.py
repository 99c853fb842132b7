"""Document-masked attention under pipeline parallelism trains exactly like one process.

Every pipeline stage runs the user's ``training_step`` on its micro-batch, the whole batch dict included,
so the reference model builds the block-diagonal mask from ``document_ids`` on every stage and each
stage's blocks attend within documents. The oracle is one process on the same data; the same run
without document ids shows the mask matters (its losses differ by far more than the tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_llm.data import LLMDataModule
from lightning_llm.data.token_files import TokenFileInfo, offsets_path, write_token_info
from lightning_llm.testing import run_distributed
from tests.strategies._parity import GLOBAL_BATCH, assert_parity, train, train_layouts

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {
    "pp2-1f1b": {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B", "num_microbatches": 4},
    "pp2-interleaved1f1b-v2": {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "Interleaved1F1B",
        "num_microbatches": 4,
        "virtual_stages": 2,
    },
}


def _write_documents(path, num_documents: int = 400, seed: int = 0) -> str:
    """Short documents (3 to 12 tokens, then EOS = 0), so every 33-token window spans several of them."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 256, rng.integers(3, 13)), 0) for _ in range(num_documents)]
    tokens = np.concatenate(docs).astype(np.uint16)
    tokens.tofile(path)
    starts = np.cumsum([0] + [len(d) for d in docs]).astype(np.uint64)  # document starts, then the total
    starts.tofile(offsets_path(path))
    write_token_info(path, TokenFileInfo("uint16", 256, 0, None, num_documents, len(tokens)))
    return str(path)


def _data(path: str, documents: bool) -> LLMDataModule:
    return LLMDataModule(
        source="tokens", path=path, seq_len=32, batch_size=GLOBAL_BATCH, seed=3, return_document_ids=documents
    )


def test_document_ids_reach_every_pipeline_stage(tmp_path):
    path = _write_documents(tmp_path / "train.bin")
    masked = train("reference", layers=4, datamodule=_data(path, True))
    unmasked = train("reference", layers=4, datamodule=_data(path, False))
    # The mask matters on this data: without it the losses part from the masked run's well beyond 1e-5.
    gap = (torch.tensor(masked[0]) - torch.tensor(unmasked[0])).abs().max().item()
    assert gap > 1e-2, f"document masking changed the losses by only {gap:.1e}; the data does not test it"

    results = run_distributed(
        train_layouts, 2, "reference", list(LAYOUTS.values()), 2, layers=4, datamodule=_data(path, True), timeout=540
    )[0]
    for label, result in zip(LAYOUTS, results):
        assert_parity(result, masked, f"document ids under {label}")
