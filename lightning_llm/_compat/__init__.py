"""The only place in ``lightning_llm`` that touches private (underscore) APIs of torch, Lightning, DeepSpeed and
transformers.

Each private access is a named function or constant in a module per upstream and topic (:mod:`.torch`,
:mod:`.torch_kernels`, :mod:`.torch_distributed`, :mod:`.lightning`, :mod:`.lightning_strategies`, :mod:`.deepspeed`,
:mod:`.transformers`), documented with what it is, why no public API does it, and the versions it was checked on,
and registered in :data:`LEDGER` (``python -m lightning_llm._compat.ledger`` prints it as the Markdown table of
``docs/internals.md``).
Symbols that an older supported version may lack are imported when called, and raise a ``RuntimeError`` naming
the feature and the version it needs; importing ``lightning_llm`` never fails because of them.
"""

from lightning_llm._compat import (
    deepspeed,
    lightning,
    lightning_strategies,
    torch,
    torch_distributed,
    torch_kernels,
    transformers,
)
from lightning_llm._compat.registry import LEDGER, Private

__all__ = [
    "LEDGER",
    "Private",
    "deepspeed",
    "lightning",
    "lightning_strategies",
    "torch",
    "torch_distributed",
    "torch_kernels",
    "transformers",
]
