"""``python -m lightning_llm.cli``: the same as the ``lightning-llm`` console script."""

from lightning_llm.cli import main

main()
