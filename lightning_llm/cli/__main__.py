"""``python -m lightning_llm.cli``: the same as the ``lightning-llm`` console script."""

from lightning_llm.cli import main

if __name__ == "__main__":
    main()
