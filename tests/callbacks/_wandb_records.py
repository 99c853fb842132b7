"""Read the history keys of an offline W&B run from its ``.wandb`` file (tests only).

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
records, each with a 7-byte header (crc32, length, type: full / first / middle / last) and a
protobuf ``Record``. wandb no longer ships a Python reader for it, so this is the minimum to read one.
"""

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    offset, pending = _HEADER, b""
    while offset + _HEADER <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < _HEADER:  # block tail too short for a header: zero padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[offset + _HEADER : offset + _HEADER + length]
        offset += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def history(run_file: Path) -> list[dict[str, float]]:
    """Each logged step of the run as {metric name: value}."""
    rows = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                try:
                    row[key] = float(item.value_json)
                except ValueError:
                    row[key] = item.value_json
            rows.append(row)
    return rows
