import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _fresh_seed(monkeypatch):
    # L.seed_everything() exports PL_GLOBAL_SEED, and Lightning re-seeds every new process from it:
    # one test's seed must not leak into the ranks another test spawns.
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)
    torch.manual_seed(0)
    yield
    # A seed set during the test is not undone by monkeypatch (the variables were absent when it ran),
    # and would reach the ranks a later module-scoped fixture spawns: drop it here.
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(name, None)
