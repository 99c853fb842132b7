"""The package's warning filters last as long as the run that needs them: none at import, none left after fit."""

from __future__ import annotations

import subprocess
import sys
import warnings

import lightning as L
import torch

from lightning_llm import LLMParallelStrategy
from lightning_llm._compat.known_warnings import KNOWN, ScopedFilters
from lightning_llm.parallel.output_views import VIEW_WARNING, OutputViewGuard
from lightning_llm.testing import cpu_trainer
from lightning_llm.testing.models import UserLM

IMPORT_CHECK = """
import warnings, torch, lightning
before = list(warnings.filters)
import lightning_llm
added = [f for f in warnings.filters if f not in before]
assert not added, added
"""


def test_importing_the_package_adds_no_warning_filter():
    subprocess.run([sys.executable, "-c", IMPORT_CHECK], check=True, timeout=120)


class _Filters(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.during = list(warnings.filters)


def test_a_fit_removes_the_filters_it_added():
    before = list(warnings.filters)
    torch.manual_seed(0)
    seen = _Filters()
    trainer = cpu_trainer(devices=1, strategy=LLMParallelStrategy(zero_stage=0), max_steps=1, callbacks=[seen])
    tokens = torch.randint(0, 64, (4, 9))
    trainer.fit(UserLM(layers=1), torch.utils.data.DataLoader(tokens, batch_size=2))
    assert any(f[1] is not None and f[1].pattern == next(iter(KNOWN)) for f in seen.during)  # filtered in the run
    assert warnings.filters == before


def test_the_output_view_guard_filters_until_closed():
    before = list(warnings.filters)
    guard = OutputViewGuard([])
    assert any(f[1] is not None and f[1].pattern == VIEW_WARNING for f in warnings.filters)
    guard.close()
    assert warnings.filters == before
    guard.silence()  # a later fit of the same model
    guard.silence()  # twice: still one filter
    assert sum(f[1] is not None and f[1].pattern == VIEW_WARNING for f in warnings.filters) == 1
    guard.close()
    assert warnings.filters == before


def test_a_filter_already_in_place_stays_with_its_owner():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=VIEW_WARNING)  # the user's (or an enclosing scope's)
        outer = list(warnings.filters)
        inner = ScopedFilters()
        inner.ignore(VIEW_WARNING)
        inner.remove()
        assert warnings.filters == outer
