"""Options declared once: each a dataclass field carrying its argument's default, documentation and check.

A strategy's options are frozen, keyword-only dataclasses whose fields are declared with :func:`option`. The
field's type is the checked value the code reads; its metadata hold what the strategy's argument needs: the
default, the sentence its docstring shows and the check that turns the given value into the stored one. From
that one table come the checks run at construction (:func:`check_each`), the strategy's ``Arguments:`` docstring
section and one read-only strategy attribute per option (:func:`with_declared_options`). The strategy's
``__init__`` keeps explicit, typed arguments: LightningCLI (jsonargparse) reads its signature.

Example::

    @dataclass(frozen=True, kw_only=True)
    class LoggingOptions:
        every_n_steps: int = option(50, "steps between two log lines.", check=positive_int())
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Check = Callable[[str, Any], Any]  # (argument name, given value) -> the value stored; raises on a bad one
_KEY = "lightning_llm.option"
_MARKER = re.compile(r"^(?P<indent>[ \t]*)\{arguments\}[ \t]*$", re.MULTILINE)


def _unchanged(name: str, value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Declaration:
    """One option: the strategy ``argument`` it comes from, where the checked value is kept (``path``, attribute
    names from the options object down), the argument's ``default``, its ``doc`` and its ``check``."""

    argument: str
    path: tuple[str, ...]
    default: Any
    doc: str
    check: Check

    def read(self, options: Any) -> Any:
        """The checked value of this option in ``options``."""
        for name in self.path:
            options = getattr(options, name)
        return options


def option(default: Any, doc: str, *, check: Check | None = None, argument: str | None = None) -> Any:
    """A dataclass field declaring one option (see the module docstring).

    Arguments:
        default: the strategy argument's default (the field has none: options are built from checked values).
        doc: what the argument does, as the strategy's docstring shows it (reStructuredText, one paragraph).
        check: ``check(name, value)`` returns the value to keep, or raises naming the value and the fix.
        argument: the strategy's argument name where it differs from the field's (``pipeline_schedule`` for
            ``PipelineOptions.schedule``).
    """
    spec = {"default": default, "doc": " ".join(doc.split()), "check": check or _unchanged, "argument": argument}
    return dataclasses.field(metadata={_KEY: spec})


def declarations(options_type: type, path: tuple[str, ...] = ()) -> Iterator[Declaration]:
    """Every option declared in ``options_type``, in field order; a field holding another options dataclass (a
    group) contributes its options."""
    for field in dataclasses.fields(options_type):
        spec = field.metadata.get(_KEY)
        if spec is None:  # a group: its type is a dataclass of options
            yield from declarations(_resolved_type(options_type, field), (*path, field.name))
        else:
            argument = spec["argument"] or field.name
            yield Declaration(argument, (*path, field.name), spec["default"], spec["doc"], spec["check"])


def _resolved_type(owner: type, field: dataclasses.Field) -> type:
    """A group field's class, also where ``from __future__ import annotations`` left its type a string."""
    return typing.get_type_hints(owner)[field.name]


def check_each(options_type: type, arguments: dict[str, Any]) -> dict[tuple[str, ...], Any]:
    """Each option's own check on ``arguments`` (every option's argument, by name), in declaration order: the
    checked values keyed by their path. An argument without a declaration is refused, not dropped."""
    declared = list(declarations(options_type))
    names = {d.argument for d in declared}
    if set(arguments) != names:
        raise TypeError(
            f"{options_type.__name__} declares no option {sorted(set(arguments) - names)} and misses "
            f"{sorted(names - set(arguments))}: declare each argument once with option(...)."
        )
    return {d.path: d.check(d.argument, arguments[d.argument]) for d in declared}


def build(options_type: type, checked: dict[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    """The frozen options object holding ``checked`` values (from :func:`check_each`), built by keyword."""
    values = {}
    for field in dataclasses.fields(options_type):
        here = (*path, field.name)
        if _KEY in field.metadata:
            values[field.name] = checked[here]
        else:
            values[field.name] = build(_resolved_type(options_type, field), checked, here)
    return options_type(**values)


def arguments_section(options_type: type, signature: inspect.Signature, indent: str = "") -> str:
    """The strategy's ``Arguments:`` entries, in its signature's order, each ``name: doc`` wrapped at 116 columns."""
    docs = {d.argument: d.doc for d in declarations(options_type)}
    lines = []
    for name in signature.parameters:
        if name in docs:
            lines += textwrap.wrap(
                f"{name}: {docs[name]}",
                width=116,
                initial_indent=indent,
                subsequent_indent=indent + "    ",
                break_on_hyphens=False,
                break_long_words=False,
            )
    return "\n".join(lines)


def with_declared_options(options_type: type, attribute: str = "options") -> Callable[[type], type]:
    """A class decorator for a strategy whose ``__init__`` keeps its checked ``options_type`` in ``attribute``.

    It writes the ``Arguments:`` entries where the class docstring has the line ``{arguments}``, and gives the
    class one read-only attribute per option, named as its argument (``strategy.fp8``: the checked value), unless
    the class or a base already defines that name (Lightning's ``process_group_backend``).
    """

    def decorate(cls: type) -> type:
        doc = cls.__doc__ or ""
        marker = _MARKER.search(doc)
        if marker is not None:
            section = arguments_section(options_type, inspect.signature(cls.__init__), marker["indent"])
            cls.__doc__ = doc[: marker.start()] + section + doc[marker.end() :]
        for declaration in declarations(options_type):
            if not hasattr(cls, declaration.argument):
                setattr(cls, declaration.argument, Forwarded(".".join((attribute, *declaration.path))))
        return cls

    return decorate


class Forwarded:
    """A public attribute of the strategy kept in its options or run state, e.g. ``Forwarded("options.parallel.fp8")``.

    Read-only when it names an option (they are frozen); assignable when it names run state.
    """

    def __init__(self, path: str) -> None:
        *self.owner, self.name = path.split(".")

    def _holder(self, obj):
        for part in self.owner:
            obj = getattr(obj, part)
        return obj

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(self._holder(obj), self.name)

    def __set__(self, obj, value) -> None:
        setattr(self._holder(obj), self.name, value)  # frozen options raise FrozenInstanceError
