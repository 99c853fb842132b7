"""What ``lightning-llm`` prints when a run cannot start: one message naming the problem and the fix, once.

Three kinds of mistakes end a run before its first step, and each would otherwise print pages:

- a config file that is missing, unreadable, binary or not YAML (:func:`check_config_files`, before anything parses it);
- a command line or config the parser refuses: jsonargparse prints its whole usage (some 45 lines for ``fit``)
  before the message; :class:`ConciseParser` prints the message alone, with the closest option name for a typo
  (:func:`concise`), and :func:`unknown_strategy` lists the package's presets for a strategy name nobody registered;
- an error raised by setup (a refused layout, a model the strategy cannot split): every rank raises it, so a
  2-rank run printed the same traceback twice. :func:`report_before_first_step` prints it on rank 0 only, without
  the traceback unless asked (``--traceback`` or ``LIGHTNING_LLM_TRACEBACK=1``).

Errors after the first step keep Python's traceback: they are bugs to debug, not mistakes in a command.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser

TRACEBACK_FLAG, TRACEBACK_ENV = "--traceback", "LIGHTNING_LLM_TRACEBACK"
PROG = "lightning-llm"


class CommandError(Exception):
    """A mistake in the command or its config: printed as one message, exit status 2."""


def check_config_files(argv: list[str]) -> None:
    """Refuse each ``--config``/``-c`` file that is missing, unreadable, not UTF-8 text or not YAML, naming it."""
    for path in _config_arguments(argv):
        file = Path(path)
        if not file.exists():
            raise CommandError(f"config file {path} does not exist (looked in {file.resolve().parent}).")
        if not file.is_file():
            raise CommandError(f"config file {path} is a directory; pass a YAML file, e.g. configs/tiny.yaml.")
        try:
            yaml.safe_load(file.read_text(encoding="utf-8"))
        except OSError as err:
            raise CommandError(f"config file {path} cannot be read: {err.strerror or err}.") from err
        except UnicodeDecodeError as err:
            raise CommandError(
                f"config file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                "pass a YAML file, e.g. configs/tiny.yaml."
            ) from err
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" (line {where.line + 1})" if where is not None else ""
            raise CommandError(f"config file {path} is not valid YAML{line}: {getattr(err, 'problem', err)}.") from err


def _config_arguments(argv: list[str]) -> Iterable[str]:
    for index, arg in enumerate(argv):
        if arg in ("-c", "--config") and index + 1 < len(argv):
            yield argv[index + 1]
        elif arg.startswith("--config="):
            yield arg.split("=", 1)[1]


class ConciseParser(LightningArgumentParser):
    """LightningCLI's parser whose errors are the message alone (with the closest option for a typo), not the usage
    of every option first."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        options = list(getattr(parser, "_option_string_actions", {}))
        sys.stderr.write(f"{prog}: error: {concise(message, options)}\n(`{prog} --help` lists what it accepts)\n")
        sys.exit(2)


def concise(message: str, options: list[str] = ()) -> str:
    """jsonargparse's message without its nested detail where one sentence says it, with a suggestion for a typo.

    Example::

        concise("... class_path 'lightning_llm.LLMParallelStrategy':\\n  Option 'tensor_paralel_size' is not accepted")
        # "LLMParallelStrategy has no option 'tensor_paralel_size'; did you mean 'tensor_parallel_size'?"
    """
    missing = re.search(r"File does not exist: '([^']+)'", message)
    if missing:
        return f"config file {missing.group(1)} does not exist."
    option = re.search(r"Option '([^']+)' is not accepted", message)
    owner = re.search(r"class_path '([\w.]+)'", message)
    if option and owner:
        name, cls = option.group(1), _import(owner.group(1))
        accepted = list(inspect.signature(cls.__init__).parameters)[1:] if cls is not None else []
        return f"{owner.group(1).rsplit('.', 1)[-1]} has no option {name!r}{_suggestion(name, accepted)}"
    unrecognized = re.search(r"unrecognized arguments: ([^\s)]+)", message, re.IGNORECASE)
    if unrecognized:
        given = unrecognized.group(1).split("=", 1)[0]
        return f"unknown option {given}{_suggestion(given, options)}"
    # A union's errors (a strategy is "a name or a class"): the reason its class gave, not the names it tried.
    reasons = [
        line.strip()[2:]
        for line in message.splitlines()
        if line.strip().startswith("- ") and not line.strip().startswith(("- Expected a <class", "- Problem with"))
    ]
    return "; ".join(reasons) if reasons and "Errors:" in message else message.strip()


def unknown_strategy(name: str, registered: list[str], presets: list[str]) -> str | None:
    """The refusal of a strategy name nobody registered (Lightning's own lists a few examples, none of ours)."""
    if name == "auto" or name in registered:
        return None
    lightning = ["auto", *sorted(n for n in registered if not n.startswith("llm_") and "find_unused" not in n)]
    return (
        f"unknown strategy {name!r}{_suggestion(name, [*presets, *lightning])} lightning_llm's presets: "
        f"{', '.join(presets)}. Lightning's: {', '.join(lightning)}. Or a class, e.g. --trainer.strategy "
        "LLMParallelStrategy --trainer.strategy.tensor_parallel_size 2 (docs/cli.md, 'Strategy presets')."
    )


def _suggestion(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else "."


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def wants_traceback(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--traceback``, and whether the traceback of an early error was asked for (the flag is
    passed on to the ranks Lightning launches through the environment)."""
    kept = [arg for arg in argv if arg != TRACEBACK_FLAG]
    if len(kept) != len(argv):
        os.environ[TRACEBACK_ENV] = "1"
    return kept, os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def report_before_first_step(err: BaseException, command: str) -> int:
    """Print an error that ended the run before its first step: on rank 0 only, as ``PROG COMMAND: error: ...``
    and how to see the traceback; the exit status to leave with."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if isinstance(err, CommandError):
        message, status = str(err), 2
    elif isinstance(err, (ValueError, TypeError, RuntimeError)):
        message, status = concise(str(err)), 1  # a refusal's sentence names the value, the constraint and the fix
    else:
        message, status = f"{type(err).__name__}: {err}", 1
    if getattr(rank_zero_only, "rank", 0) == 0:
        hint = "" if status == 2 else f"\n(the traceback: add {TRACEBACK_FLAG}, or set {TRACEBACK_ENV}=1)"
        sys.stderr.write(f"{PROG}{f' {command}' if command else ''}: error: {message}{hint}\n")
    return status


class FirstBatch(Callback):
    """Marks the run started at its first batch (training, validation, test or prediction): an error after it is
    reported with Python's traceback."""

    started = False

    def _start(self, *args: Any) -> None:
        FirstBatch.started = True

    on_train_batch_start = on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _start


def run_started() -> bool:
    """Whether a batch of this process's run has started (see :class:`FirstBatch`)."""
    return FirstBatch.started
