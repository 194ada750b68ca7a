"""Read an offline W&B run file (``run-<id>.wandb``) back, for tests.

wandb 0.31 writes offline runs as one binary file and nothing else: a
LevelDB-style log of ``wandb_internal_pb2.Record`` messages. Layout: a 7-byte file header
(``:W&B``, magic 0xBEE1, version), then 32 KiB blocks of records, each with a 7-byte
header (CRC32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last); a block's
tail shorter than a header is padding.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, List

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[pb.Record]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block  # padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0  # zero-filled rest of a block
            continue
        if kind in (FULL, FIRST):
            pending = chunk
        elif kind in (MIDDLE, LAST):
            pending += chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_run(path: Path) -> Dict[str, Any]:
    """history (list of dicts), summary, config, group, job_type, name, exit_code."""
    run: Dict[str, Any] = {"history": [], "summary": {}, "config": {}, "exit_code": None}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.update(group=rec.run.run_group, job_type=rec.run.job_type, name=rec.run.display_name)
            run["tags"] = list(rec.run.tags)
            for item in rec.run.config.update:
                run["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                run["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                run["summary"][_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            run["exit_code"] = rec.exit.exit_code
    return run


def find_runs(output_dir: Path) -> List[Path]:
    return sorted(Path(output_dir).glob("wandb/offline-run-*/run-*.wandb"))
