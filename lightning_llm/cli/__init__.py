"""``lightning-llm``: a LightningCLI with the reference model and data module as defaults, and its subcommands.

Any LightningModule / LightningDataModule can replace them with ``class_path`` in the config.
W&B is configured the way W&B itself is (``wandb login``, ``wandb offline``, ``WANDB_MODE``,
``WANDB_API_KEY``); only where none of them is set does the CLI log offline, and says so
(:mod:`lightning_llm.wandb_mode`). ``app`` holds the LightningCLI, ``plan`` the memory plan, ``errors`` what is
printed when a run cannot start (one message, on rank 0; the traceback with ``--traceback``).

Example::

    lightning-llm fit --config configs/tiny.yaml
    lightning-llm fit --config configs/tiny.yaml --trainer.max_steps 50 --model.init_args.learning_rate 1e-3
    lightning-llm plan --config configs/llama7b.yaml --devices 8 --device_memory 80GB
    lightning-llm prepare corpus/ --output_dir data --vocab_size 32000 --val_fraction 0.01 --workers 8
    lightning-llm export checkpoints/last.ckpt export/hf --format hf --dtype bfloat16
"""

from __future__ import annotations

import sys

from lightning_llm._compat.known_warnings import ScopedFilters
from lightning_llm.cli import errors
from lightning_llm.cli.app import LLMCLI, WANDB_INSTALL_HINT, ConfigToLoggers, run_name, wandb_installed
from lightning_llm.cli.plan import plan

__all__ = ["LLMCLI", "WANDB_INSTALL_HINT", "ConfigToLoggers", "main", "plan", "run_name", "wandb_installed"]

# Every subcommand and what it does: `lightning-llm --help` lists them all (LightningCLI's own help knows its four).
SUBCOMMANDS = {
    "fit": "train: the full optimization routine (--config configs/tiny.yaml)",
    "validate": "one evaluation epoch over the validation set",
    "test": "one evaluation epoch over the test set",
    "predict": "run inference on your data",
    "plan": "the memory plan and ZeRO decision for a config, without training or allocating",
    "prepare": "tokenize .txt/.jsonl files into the token files --data.source tokens reads",
    "export": "write a checkpoint of any layout as a Hugging Face directory or one torch file",
}


def usage() -> str:
    """The top-level help: every subcommand, LightningCLI's and the package's own."""
    names = ",".join(SUBCOMMANDS)
    rows = "\n".join(f"  {name:<10}{text}" for name, text in SUBCOMMANDS.items())
    return (
        f"usage: {errors.PROG} [-h] [-c CONFIG] {{{names}}} ...\n\n"
        "Train decoder LLMs with Lightning: LightningCLI's subcommands, with the reference model and data as\n"
        "defaults and the llm_* strategy presets registered, and three subcommands of the package's own.\n\n"
        f"subcommands (`{errors.PROG} SUBCOMMAND --help` lists each one's options):\n{rows}\n\n"
        "options:\n"
        "  -h, --help            show this help message and exit\n"
        "  -c CONFIG, --config CONFIG\n"
        "                        a YAML or JSON config, before or after the subcommand\n"
        f"  {errors.TRACEBACK_FLAG:<22}show the traceback of an error that stops a run before its first step\n"
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-llm`` console script."""
    argv, traceback = errors.wants_traceback(sys.argv[1:] if args is None else list(args))
    if args is None:
        sys.argv[1:] = argv  # LightningCLI reads sys.argv itself (and Lightning relaunches it for the other ranks)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0)  # as argparse's --help does
    command = next((arg for arg in argv if arg in SUBCOMMANDS), "")
    errors.FirstBatch.started = False  # this call's run (main may be called again in one process)
    filters = ScopedFilters()  # for this command, whatever strategy it runs (lightning_llm._compat.known_warnings)
    filters.ignore_known()
    try:
        _run(argv)
    except Exception as err:
        if traceback or errors.run_started():
            raise
        sys.exit(errors.report_before_first_step(err, command))
    finally:
        filters.remove()


def _run(argv: list[str]) -> None:
    if argv[0] == "prepare":
        from lightning_llm.data.prepare import command

        command(argv[1:])
        return
    if argv[0] == "export":
        from lightning_llm import export

        export.main(argv[1:])
        return
    errors.check_config_files(argv)
    if argv[0] == "plan":
        plan(argv[1:])
        return
    LLMCLI(args=None if sys.argv[1:] == argv else argv)
