"""A pickled object that creates a file when fully unpickled: the stand-in for any code a crafted checkpoint runs."""

from __future__ import annotations

from pathlib import Path


class Payload:
    """Unpickled by a full unpickler, this calls ``Path(marker).touch()``: the stand-in for any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))
