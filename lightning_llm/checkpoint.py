"""``python -m lightning_llm.checkpoint CKPT OUT``: consolidate a checkpoint into one file plain torch loads.

The command-line entry point kept at its public name; the work is :mod:`lightning_llm.checkpointing.consolidate`.
"""

from lightning_llm.checkpointing.consolidate import consolidate_checkpoint, main, read_model_state

__all__ = ["consolidate_checkpoint", "main", "read_model_state"]

if __name__ == "__main__":
    main()
