import os
import warnings

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _fresh_seed(monkeypatch, request):
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
    # Autograd left off would make later tests of training-only behaviour pass or fail by order: restore it,
    # and name the test that left it off.
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        warnings.warn(f"{request.node.nodeid} left autograd disabled; re-enabled for the next test", stacklevel=1)
