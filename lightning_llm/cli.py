"""``lightning-llm``: a LightningCLI with the reference model and data module as defaults.

Any LightningModule / LightningDataModule can replace them with ``class_path`` in the config.
W&B runs offline unless the user configured W&B (an API key or ``WANDB_MODE``), so the CLI
works on machines with no network.

Example::

    lightning-llm fit --config configs/tiny.yaml
    lightning-llm fit --config configs/tiny.yaml --trainer.max_steps 50 --model.init_args.learning_rate 1e-3
"""

from __future__ import annotations

import os

from jsonargparse import lazy_instance
from lightning.pytorch.cli import LightningCLI

from lightning_llm.data import LLMDataModule
from lightning_llm.models import CausalLM


class LLMCLI(LightningCLI):
    """LightningCLI whose model and data default to :class:`CausalLM` and :class:`LLMDataModule`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(None, None, *args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"model": lazy_instance(CausalLM), "data": lazy_instance(LLMDataModule)})


def _default_wandb_offline() -> None:
    if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-llm`` console script."""
    _default_wandb_offline()
    LLMCLI(args=args)


if __name__ == "__main__":
    main()
