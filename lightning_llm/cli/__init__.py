"""``lightning-llm``: a LightningCLI with the reference model and data module as defaults, and its subcommands.

Any LightningModule / LightningDataModule can replace them with ``class_path`` in the config.
W&B is configured the way W&B itself is (``wandb login``, ``wandb offline``, ``WANDB_MODE``,
``WANDB_API_KEY``); only where none of them is set does the CLI log offline, and says so
(:mod:`lightning_llm.wandb_mode`). ``app`` holds the LightningCLI, ``plan`` the memory plan.

Example::

    lightning-llm fit --config configs/tiny.yaml
    lightning-llm fit --config configs/tiny.yaml --trainer.max_steps 50 --model.init_args.learning_rate 1e-3
    lightning-llm plan --config configs/llama7b.yaml --devices 8 --device_memory 80GB
    lightning-llm prepare corpus/ --output_dir data --vocab_size 32000 --val_fraction 0.01 --workers 8
    lightning-llm export checkpoints/last.ckpt export/hf --format hf --dtype bfloat16
"""

from __future__ import annotations

import sys

from lightning_llm.cli.app import LLMCLI, WANDB_INSTALL_HINT, ConfigToLoggers, run_name, wandb_installed
from lightning_llm.cli.plan import plan

__all__ = ["LLMCLI", "WANDB_INSTALL_HINT", "ConfigToLoggers", "main", "plan", "run_name", "wandb_installed"]


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-llm`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["plan"]:
        plan(argv[1:])
        return
    if argv[:1] == ["prepare"]:
        from lightning_llm.data.prepare import command

        command(argv[1:])
        return
    if argv[:1] == ["export"]:
        from lightning_llm import export

        export.main(argv[1:])
        return
    LLMCLI(args=args)
