"""``lightning-llm export``: a trained checkpoint of any layout -> a Hugging Face directory or one torch file.

Example::

    lightning-llm export checkpoints/step=1000.ckpt export/hf --format hf --dtype bfloat16
    lightning-llm export checkpoints/step=1000.ckpt export/full.pt --format torch
    lightning-llm export last.ckpt export/hf --format hf --hf_config path/to/the/pretrained/model

Prints only the path it wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import warnings
from pathlib import Path

from lightning_llm.checkpointing.consolidate import DTYPES


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-llm export``."""
    parser = argparse.ArgumentParser(
        prog="lightning-llm export",
        description="Write a trained checkpoint (a sharded directory saved by LLMParallelStrategy under any tp/pp/ZeRO "
        "layout, or a .ckpt file) as a Hugging Face directory or one torch file.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (DCP) or .ckpt file")
    parser.add_argument("output", help="output directory (--format hf) or file (--format torch)")
    parser.add_argument(
        "--format",
        choices=("hf", "torch"),
        default="hf",
        help="hf: config.json + model.safetensors for transformers' from_pretrained; torch: one file "
        "with Lightning's full checkpoint (state_dict, optimizer, loops) for torch.load",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: as saved)")
    parser.add_argument(
        "--hf_config",
        help="Hugging Face directory or config.json of the model, for checkpoints that "
        "do not record it (saved by another strategy); --format hf only",
    )
    parser.add_argument("--max_shard_size", default="5GB", help="split model.safetensors above this size (--format hf)")
    return parser


@contextlib.contextmanager
def _quiet():
    """No progress bars or info logs from transformers: the command prints one line, the output path."""
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    level = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.utils.logging.set_verbosity(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def main(args: list[str]) -> Path:
    """Run ``lightning-llm export`` with command-line ``args``; returns the path written."""
    cli = parser()
    options = cli.parse_args(args)
    if options.format == "torch" and options.hf_config is not None:
        cli.error("--hf_config applies to --format hf only; a torch export keeps the checkpoint's own names.")
    try:
        written = _export(options)
    except (ValueError, FileNotFoundError) as err:  # the message names the value and the fix; no traceback
        cli.exit(1, f"{cli.prog}: error: {err}\n")
    print(written)
    return written


def _export(options: argparse.Namespace) -> Path:
    if options.format == "torch":
        from lightning_llm.checkpointing.consolidate import consolidate_checkpoint

        return consolidate_checkpoint(options.checkpoint, options.output, options.dtype)
    from lightning_llm.hf.export import export_hf

    logging.getLogger("lightning_llm").setLevel(logging.WARNING)
    with _quiet():
        return export_hf(
            options.checkpoint,
            options.output,
            dtype=options.dtype,
            hf_config=options.hf_config,
            max_shard_size=options.max_shard_size,
        )
