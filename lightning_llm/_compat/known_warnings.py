"""Warning filters the package adds for the length of a run, and removes when the run ends.

:data:`KNOWN` holds the deprecations one upstream package raises about another's code, that a user can do nothing
about and that change nothing in the run, filtered by their exact text. Nothing else is filtered: warnings about the
user's code or setup stay visible. No filter is added at import: a strategy adds them in ``setup_environment`` and
removes them at ``teardown``, the ``lightning-llm`` command for its run (:class:`ScopedFilters`), so a process that
trains and then does something else sees every warning again.
"""

from __future__ import annotations

import warnings

KNOWN = {
    # Lightning 2.6.6's lightning/pytorch/utilities/_pytree.py checks `isinstance(spec, LeafSpec)` for every batch,
    # which torch 2.13 deprecates in favour of `spec.is_leaf()`. The check still answers the same; once per rank.
    r".*isinstance\(treespec, LeafSpec\)` is deprecated.*": "Lightning's batch-size detection under torch >= 2.13",
}


class ScopedFilters:
    """``warnings.filterwarnings("ignore", ...)`` entries that :meth:`remove` takes out again, and only them.

    ``warnings.catch_warnings`` cannot serve: the warnings filtered here are raised long after the call that knows
    about them returns (Lightning's fit loop, torch's backward), and restoring the whole filter list at the end would
    also undo filters the user added meanwhile.

    Example::

        filters = ScopedFilters()
        filters.ignore(".*returned a view tensor.*")
        ...  # the run
        filters.remove()
    """

    def __init__(self) -> None:
        self._added: list[tuple] = []

    def ignore(self, message: str, category: type[Warning] = Warning) -> None:
        """Ignore warnings of ``category`` whose text matches ``message`` (a regex) until :meth:`remove`.

        A filter that is already in place (the user's, or an enclosing scope's: the ``lightning-llm`` command around
        a strategy) is left to its owner: :meth:`remove` does not take it out.
        """
        before = list(warnings.filters)
        warnings.filterwarnings("ignore", message=message, category=category)
        if warnings.filters[0] not in before:
            self._added.append(warnings.filters[0])

    def ignore_known(self) -> None:
        """Ignore the :data:`KNOWN` upstream deprecations."""
        for message in KNOWN:
            self.ignore(message)

    def remove(self) -> None:
        """Take out every filter this object added, and only those."""
        for entry in reversed(self._added):
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        self._added.clear()
