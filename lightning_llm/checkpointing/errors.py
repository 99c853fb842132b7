"""Save failures, made uniform: caught on the rank where they happen, shared with every rank, described once.

A failed write must not leave ranks in different collectives (one raising, the others waiting in a
barrier until the timeout), and the user should read the cause (no space, permission) instead of
``unexpected pos 704 vs 598``. ``torch.distributed.checkpoint`` reports failures as
``CheckpointException``, a ``BaseException``, so :data:`SAVE_ERRORS` names it explicitly.
"""

from __future__ import annotations

import builtins
import errno
import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.plugins.io import CheckpointIO
from torch.distributed.checkpoint.api import CheckpointException

SAVE_ERRORS = (Exception, CheckpointException)  # not KeyboardInterrupt/SystemExit: those stop the run as they are
_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}
_LOW_SPACE = 64 * 2**20


class SaveFailed(RuntimeError):
    """A save that failed on some rank, raised alike on every rank; ``cause`` says on which ranks and why.

    :meth:`like` gives the subclass that is also the original error's built-in type, so code written for
    Lightning's strategies (``except IsADirectoryError``) still catches it.
    """

    def __init__(self, path, cause: str) -> None:
        super().__init__(f"Saving checkpoint {path} failed: {cause}")
        self.cause = cause

    @staticmethod
    def like(kind: str | None) -> type[SaveFailed]:
        """``SaveFailed`` that is also the built-in exception named ``kind`` (``"IsADirectoryError"``); plain
        ``SaveFailed`` for any other name. Example: ``raise SaveFailed.like("PermissionError")(path, cause)``."""
        base = getattr(builtins, kind, None) if kind else None
        if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(SaveFailed, base):
            return SaveFailed
        return _typed(base)


@functools.cache
def _typed(base: type[Exception]) -> type[SaveFailed]:
    def new(cls, path, cause: str):
        return base.__new__(cls, f"Saving checkpoint {path} failed: {cause}")

    return type(f"SaveFailed[{base.__name__}]", (SaveFailed, base), {"__new__": new, "__module__": __name__})


def builtin_kind(err: BaseException) -> str | None:
    """The name of the first built-in exception type in ``err``'s chain (DCP's failures included), if any."""
    for cause in _chain(err):
        if isinstance(cause, Exception) and type(cause).__module__ == "builtins":
            return type(cause).__name__
    return None


def describe(err: BaseException, directory: Path) -> str:
    """The cause of a failed save in words: the ``OSError`` behind it if any, else the error, plus free space."""
    if isinstance(err, SaveFailed):
        return err.cause
    if isinstance(err, CheckpointException):  # DCP's collective failure: what failed on which rank
        causes = [None] * (max(err.failures, default=0) + 1)
        for rank, failure in err.failures.items():
            causes[rank] = describe(failure[0], directory) if isinstance(failure, tuple) else str(failure)
        if any(causes):
            return summary(causes, name_ranks=True)
    for cause in _chain(err):
        if isinstance(cause, OSError) and cause.errno is not None:
            words = _CAUSES.get(cause.errno, cause.strerror or str(cause))
            return f"{words} ({errno.errorcode.get(cause.errno, cause.errno)}: {cause})"
    text = f"{type(err).__name__}: {err}"
    if "://" in str(directory):
        return text  # free space is a local disk's notion
    try:
        free = shutil.disk_usage(directory if Path(directory).exists() else Path(directory).parent).free
    except OSError:
        return text
    # torch's archive writer reports a full disk without the errno ("unexpected pos ..."): say what the disk says.
    return text + (
        f"; only {free} bytes are free on that device: most likely no space left" if free < _LOW_SPACE else ""
    )


class WriteFailed(OSError):
    """Writing an output failed (no space, no permission, a file-size limit); the message names the output and the
    cause in words, where torch says ``[enforce fail at inline_container.cc] ... unexpected pos``."""


def write_named(
    output: Path,
    write: Callable[[], object],
    leftover: Path | None = None,
    errors: tuple[type[Exception], ...] = (OSError, RuntimeError),
) -> None:
    """Run ``write()``, which writes ``output`` (or ``leftover``, a temporary file on its way there); a failure
    (``errors``: torch's archive writer raises ``RuntimeError``) becomes :class:`WriteFailed` naming ``output``, and
    ``leftover`` is removed.

    Example::

        write_named(Path("out/full.pt"), lambda: torch.save(state, "out/full.pt.tmp"), Path("out/full.pt.tmp"))
    """
    try:
        write()
    except errors as err:
        if leftover is not None and leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover is not None:
            leftover.unlink(missing_ok=True)
        raise WriteFailed(f"{output} could not be written: {describe(err, output.parent)}") from err


def _chain(err: BaseException) -> list[BaseException]:
    found, queue = [], [err]
    while queue and len(found) < 20:
        current = queue.pop(0)
        if current is None or current in found:
            continue
        found.append(current)
        if isinstance(current, CheckpointException):
            queue.extend(failure[0] for failure in current.failures.values() if isinstance(failure, tuple))
        queue.extend([current.__cause__, current.__context__])
    return found


def gather(error: Any) -> list[Any]:
    """Every rank's error (``None`` where it succeeded), indexed by global rank: a collective, call it on all ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return [error]
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def summary(errors: list[str | None], name_ranks: bool = False) -> str | None:
    """One line naming each distinct failure and the ranks it happened on, or ``None`` if every rank succeeded.

    One failure that every rank reports alike (a collective save that already named its ranks) is left as it is.
    """
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(errors):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    if not by_text:
        return None
    if len(by_text) == 1 and len(next(iter(by_text.values()))) == len(errors) and not name_ranks:
        return next(iter(by_text))
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}" for text, r in by_text.items())


def save_on_every_rank(save, path) -> None:
    """Run ``save()`` (a collective save) and raise :class:`SaveFailed` on every rank if it failed on any.

    For saves whose collectives all ranks pass even when a write fails (DCP shares its failures; a file
    written by rank 0 alone after them, such as Lightning's ``meta.pt``).
    """
    error = None
    try:
        save()
    except SAVE_ERRORS as err:
        error = (describe(err, Path(path).parent), builtin_kind(err))
    errors = gather(error)
    if (cause := summary([e[0] if e else None for e in errors])) is not None:
        kind = next(e[1] for e in errors if e)  # the first failing rank's error type, the same on every rank
        raise SaveFailed.like(kind)(path, cause)


class GuardedWrite(CheckpointIO):
    """Stands in for a strategy's CheckpointIO for one synchronous save: a failed write is kept in ``error``.

    Lightning's single-file save writes on rank 0 and then waits in a barrier on every rank; a write
    that raised would skip rank 0's barrier while the others wait in it. Keeping the error lets every
    rank leave the save together and report it afterwards.

    Example::

        strategy.checkpoint_io = guard = GuardedWrite(strategy.checkpoint_io)
    """

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner
        self.error: BaseException | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        try:
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        except SAVE_ERRORS as err:
            self.error = err

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)
