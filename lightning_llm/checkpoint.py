"""Turn a sharded (torch.distributed.checkpoint) Lightning checkpoint into one file plain torch can load.

A checkpoint saved by LLMParallelStrategy is a directory: one shard file per rank, DCP's
``.metadata`` and Lightning's own ``meta.pt`` (step, epoch, loops, callbacks). Any layout can
load it directly; this is for tools that want a single file.

Usage::

    python -m lightning_llm.checkpoint runs/step=1000.ckpt model.pt
    state = torch.load("model.pt", weights_only=False)["state_dict"]   # full, unsharded tensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint


def consolidate_checkpoint(checkpoint_dir: str | Path, output_file: str | Path) -> Path:
    """Write the full (unsharded) state of a sharded checkpoint directory to ``output_file``.

    The file holds Lightning's checkpoint keys (``state_dict``, ``optimizer_0``, ``global_step``,
    ...) with plain tensors, so ``torch.load(f)["state_dict"]`` fits ``model.load_state_dict``.

    Example::

        consolidate_checkpoint("checkpoints/last.ckpt", "last-full.pt")
    """
    checkpoint_dir, output_file = Path(checkpoint_dir), Path(output_file)
    if not (checkpoint_dir / ".metadata").is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir} is not a sharded checkpoint directory (no .metadata inside); "
            "a single-file checkpoint needs no consolidation."
        )
    # Lightning's loader runs DCP without a process group (no_dist) and returns full tensors.
    state = _load_distributed_checkpoint(checkpoint_dir)
    meta = checkpoint_dir / _METADATA_FILENAME
    if meta.is_file():
        state.update(torch.load(meta, weights_only=False))
    output_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, output_file)
    return output_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=consolidate_checkpoint.__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="a sharded checkpoint directory saved by LLMParallelStrategy")
    parser.add_argument("output_file", help="where to write the single-file checkpoint")
    args = parser.parse_args(argv)
    print(consolidate_checkpoint(args.checkpoint_dir, args.output_file))


if __name__ == "__main__":
    main()
