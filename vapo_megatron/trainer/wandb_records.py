"""What a W&B run directory holds, read from its transaction logs (the `run-<id>.wandb` files that
`wandb sync` uploads), with wandb's own protobuf record classes.

    steps = history_steps(run_dir / "wandb", run_id)       # {step: {key: value}} over every attempt

The pinned wandb (0.31) no longer ships a Python reader for these files, so the framing is read
here: a 7-byte file header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each
with a 7-byte header (CRC-32 of type byte + data, little-endian length, type: 1 full, 2 first,
3 middle, 4 last); a block's tail shorter than a chunk header is padding. A chunk whose checksum
fails or that runs past the end (a process killed mid-write) ends the file: what follows was never
complete. Two users: wandb_run.py asks which steps an offline run already holds, so a resume does
not log them twice, and the tests check what W&B would sync.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

_BLOCK = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """The `wandb.proto` Record messages of one transaction log, in order, up to the first torn
    or damaged chunk."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    records, parts, pos = [], b"", 7
    while pos + _CHUNK_HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER.size:
            pos += left
            continue
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        chunk = data[pos + _CHUNK_HEADER.size:pos + _CHUNK_HEADER.size + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            break
        pos += _CHUNK_HEADER.size + length
        parts = chunk if kind in (_FULL, _FIRST) else parts + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def transaction_logs(wandb_dir: Path, run_id: str) -> list[Path]:
    """Every attempt's log of run `run_id` under a W&B directory (run_dir/wandb), oldest first:
    each start of a resumed run writes a directory of its own ([offline-]run-<time>-<id>)."""
    # "-N" suffix: two starts within one second (W&B's x_sync_dir_suffix)
    logs = Path(wandb_dir).glob(f"*run-*-{run_id}*/run-{run_id}.wandb")
    return sorted(logs, key=lambda p: p.parent.name.removeprefix("offline-"))


def _value(item) -> object:
    return json.loads(item.value_json)


def history(wandb_dir: Path, run_id: str) -> list[dict[str, object]]:
    """Every history row of every attempt, in order: {"_step": N, key: value, ...} (W&B's own
    keys _timestamp and _runtime included)."""
    rows = []
    for log in transaction_logs(wandb_dir, run_id):
        for r in read_records(log):
            if r.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): _value(i) for i in r.history.item})
    return rows


def config(wandb_dir: Path, run_id: str) -> dict[str, object]:
    """The run's config as W&B holds it: the run record's config, then every config update."""
    out: dict[str, object] = {}
    for log in transaction_logs(wandb_dir, run_id):
        for r in read_records(log):
            kind = r.WhichOneof("record_type")
            updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else ()
            out |= {(i.key or "/".join(i.nested_key)): _value(i) for i in updates}
    return out


def last_step(wandb_dir: Path, run_id: str) -> int:
    """The highest history step the run's local logs hold; -1 when none."""
    return max((int(row["_step"]) for row in history(wandb_dir, run_id) if "_step" in row), default=-1)


__all__ = ["config", "history", "last_step", "read_records", "transaction_logs"]
