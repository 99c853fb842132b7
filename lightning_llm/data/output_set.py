"""``prepare``'s output set replaced as a whole: written to a staging folder, then renamed into place.

A failed or interrupted run leaves the previous run's files as they were (and no debris once a later run starts);
a successful one replaces every file of the set. The swap removes the old sidecars first, so a reader that comes
between two renames finds token files without a sidecar, which it refuses, never a sidecar describing other tokens.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from lightning_llm.data.token_files import offsets_path, sidecar_path

STAGING = ".prepare.partial"
SPLITS = ("train", "val")
TOKENIZER = "tokenizer.json"


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh staging folder inside ``out`` (the same file system, so each rename is atomic), removed afterwards."""
    stage = out / STAGING
    shutil.rmtree(stage, ignore_errors=True)  # what a killed run left
    stage.mkdir(parents=True)
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def swap_in(stage: Path, out: Path, splits: tuple[str, ...]) -> None:
    """Move the staged files of ``splits`` (and a trained tokenizer) into ``out``; remove an earlier run's split
    that this run did not write (its documents may now be in ``train``)."""
    for split in SPLITS:
        sidecar_path(out / f"{split}.bin").unlink(missing_ok=True)
    for split in set(SPLITS) - set(splits):
        for path in (out / f"{split}.bin", offsets_path(out / f"{split}.bin")):
            path.unlink(missing_ok=True)
    data = [name for split in splits for name in (f"{split}.bin", offsets_path(Path(f"{split}.bin")).name)]
    if (stage / TOKENIZER).exists():
        data.append(TOKENIZER)
    for name in data:
        os.replace(stage / name, out / name)
    for split in splits:
        os.replace(sidecar_path(stage / f"{split}.bin"), sidecar_path(out / f"{split}.bin"))
