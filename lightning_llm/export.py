"""``lightning-llm export``: a trained checkpoint of any layout -> a Hugging Face directory or one torch file.

Example::

    lightning-llm export checkpoints/step=1000.ckpt export/hf --format hf --dtype bfloat16
    lightning-llm export checkpoints/step=1000.ckpt export/full.pt --format torch
    lightning-llm export last.ckpt export/hf --format hf --hf_config path/to/the/pretrained/model

Prints only the path it wrote. The checkpoint's recorded checksums are checked first (``--no-verify`` skips it), an
existing output is replaced only with ``--overwrite``, and the output appears whole or not at all: it is written
beside its place and renamed into it, so a failed export leaves no partial directory and a re-export no stale file.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

from lightning_llm.checkpointing.consolidate import DTYPES
from lightning_llm.checkpointing.errors import WriteFailed


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
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing output (written beside it, swapped in whole)"
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="export without checking the checksums recorded when the checkpoint was saved",
    )
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
    # What libraries print meanwhile goes to stderr: DeepSpeed, imported by transformers where accelerate is
    # installed, logs its accelerator line to stdout, which scripts read for the path.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            if options.verify:
                _verify(options.checkpoint)
            written = _export_whole(options)
        except (ValueError, FileNotFoundError, OSError) as err:  # the message names the value and the fix
            cli.exit(1, f"{cli.prog}: error: {err}\n")
    print(written)
    return written


def _verify(checkpoint: str) -> None:
    """The checkpoint's files against the checksums its commit marker recorded (unmarked checkpoints pass)."""
    from lightning_llm.checkpointing.checksums import verify_committed

    try:
        verify_committed(checkpoint)
    except RuntimeError as err:
        raise ValueError(f"{err} Export another checkpoint, or pass --no-verify to export it as it is.") from None


def _export_whole(options: argparse.Namespace) -> Path:
    """Export into a sibling of the output, then rename it into place (replacing the old one only with --overwrite)."""
    output = Path(options.output)
    if "://" in str(options.output):  # a URL: no rename there, written in place
        return _export(options)
    if output.exists() and not options.overwrite:
        raise ValueError(f"{output} exists; pass --overwrite to replace it, or choose another output path.")
    if output.parent.exists() and not output.parent.is_dir():
        raise ValueError(f"{output} cannot be written: {output.parent} is a file, not a folder; choose another path.")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in the way, no permission, a read-only disk
        raise ValueError(f"{output} cannot be written: its folder {output.parent}: {err.strerror or err}.") from None
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    try:
        try:
            _export(argparse.Namespace(**{**vars(options), "output": str(partial)}))
        except WriteFailed as err:  # it names the sibling written first: say the output the user asked for
            cause = str(err).split(" could not be written: ", 1)[-1]
            raise ValueError(
                f"{output} could not be written: {cause}. Free space or fix the permissions of {output.parent}, or "
                "choose another output path."
            ) from None
        if output.exists():
            output.rename(old)
        try:
            partial.rename(output)
        except OSError:
            if old.exists():  # put the previous output back rather than lose it
                old.rename(output)
            raise
    finally:
        for leftover in (partial, old):
            if leftover.is_dir():
                shutil.rmtree(leftover)
            elif leftover.exists():
                leftover.unlink()
    return output


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
