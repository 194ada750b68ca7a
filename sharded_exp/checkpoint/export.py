"""``python -m sharded_exp.checkpoint export SRC DST``: a dcp checkpoint -> consolidated
(one process, no ranks)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from sharded_exp.checkpoint.storage import (
    CheckpointError,
    checkpoint_format,
    fsync_dir,
    load_file,
    read_meta,
    save_file,
)


def export(src: str, dst: str) -> None:
    """Convert a dcp checkpoint directory into a consolidated one (one process, no ranks)."""
    meta = read_meta(src)
    # read_meta checked .metadata through a restricted unpickler before DCP's own load below
    if checkpoint_format(meta) != "dcp":
        raise CheckpointError(f"checkpoint {src} is {checkpoint_format(meta)} already; nothing to export")
    if os.path.exists(dst):
        raise CheckpointError(f"export destination {dst} exists; choose a new directory")
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp.", dir=parent)
    flat = os.path.join(tmp, "all.pt")
    dcp_to_torch_save(src, flat)
    state = torch.load(flat, weights_only=True)  # tensors and plain containers: written just above
    os.remove(flat)
    train = load_file(os.path.join(src, "train.pt"))
    save_file({k: v.contiguous() for k, v in state["model"].items()}, os.path.join(tmp, "model.pt"))
    optim = {"state": state.get("optim", {}).get("state", {}), "param_groups": train["param_groups"]}
    save_file(optim, os.path.join(tmp, "optim.pt"))
    shutil.copyfile(os.path.join(src, "train.pt"), os.path.join(tmp, "train.pt"))
    save_file(
        {**meta, "checkpoint_format": "consolidated", "exported_from": os.path.abspath(src)},
        os.path.join(tmp, "meta.json"),
    )
    fsync_dir(tmp)
    os.rename(tmp, dst)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "export":
        print(
            "usage: python -m sharded_exp.checkpoint export SRC DST   (a dcp checkpoint -> consolidated)",
            file=sys.stderr,
        )
        return 2
    try:
        export(argv[1], argv[2])
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the destination's filesystem: read-only, full, not ours
        where = exc.filename or argv[2]
        print(
            f"error: cannot export to {argv[2]}: {exc.strerror or exc} ({where}); nothing was written", file=sys.stderr
        )
        return 1
    print(f"exported {argv[1]} -> {argv[2]} (consolidated)")
    return 0
