"""Skip markers for tests that need an optional dependency, each naming the extra that installs it.

Found with ``importlib.util.find_spec`` (nothing is imported); a module made unimportable with
``sys.modules[name] = None`` counts as missing.
"""

from __future__ import annotations

import importlib.util

import pytest


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


HAS_DEEPSPEED = installed("deepspeed")
HAS_TORCHAO = installed("torchao")
HAS_WANDB = installed("wandb")

DEEPSPEED_REASON = "needs DeepSpeed, not installed here: pip install 'lightning_llm[deepspeed]'"
TORCHAO_REASON = "needs torchao (fp8), not installed here: pip install 'lightning_llm[fp8]'"
WANDB_REASON = "needs wandb, not installed here: pip install 'lightning_llm[wandb]'"

requires_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason=DEEPSPEED_REASON)
requires_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason=TORCHAO_REASON)
requires_wandb = pytest.mark.skipif(not HAS_WANDB, reason=WANDB_REASON)
