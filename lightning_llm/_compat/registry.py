"""The ledger of upstream private APIs: one :class:`Private` per symbol, registered by the module that wraps it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Private:
    """One private (underscore) symbol of torch, Lightning, DeepSpeed or transformers that the project uses.

    Attributes:
        name: the upstream symbol, dotted as one would import or reach it.
        upstream: ``"torch"``, ``"lightning"``, ``"deepspeed"`` or ``"transformers"``.
        accessor: the name in :mod:`lightning_llm._compat` through which the project uses it.
        used_by: the project modules that call the accessor (paths under ``lightning_llm/``).
        why: what it does for the project and why no public API does it.
        caught_by: the tests that fail when upstream changes it.
        checked: the versions it was checked on.
        check: a smoke check, raising when the symbol no longer resolves on the installed versions
            (skipped, returning ``"skipped: ..."``, when the upstream package is absent).
    """

    name: str
    upstream: str
    accessor: str
    used_by: tuple[str, ...]
    why: str
    caught_by: str
    checked: str
    check: Callable[[], object] | None = field(default=None, compare=False, repr=False)


LEDGER: list[Private] = []


def register(entry: Private) -> Private:
    LEDGER.append(entry)
    return entry


def missing(feature: str, needs: str, err: BaseException) -> RuntimeError:
    """The error an accessor raises when its private symbol is absent from the installed upstream version."""
    return RuntimeError(f"{feature} needs {needs}; the installed version does not provide it ({err}).")


def resolve(dotted: str) -> object:
    """Import ``a.b.c:attr.attr`` (module before the colon, attributes after); raises when any part is missing."""
    import importlib

    module, _, attrs = dotted.partition(":")
    obj: object = importlib.import_module(module)
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr)
    return obj


def has_instance_attr(cls_path: str, attr: str) -> None:
    """Raise unless ``cls_path``'s ``__init__`` assigns ``self.<attr>``: the check of an instance attribute, which
    no class attribute would show."""
    import inspect
    import re

    cls = resolve(cls_path)
    if not re.search(rf"self\.{attr}\b\s*(:[^=\n]*)?=", inspect.getsource(cls.__init__)):
        raise AttributeError(f"{cls_path} no longer sets {attr} in __init__")
