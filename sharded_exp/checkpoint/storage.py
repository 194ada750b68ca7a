"""Where checkpoints live on disk: names, discovery, validation, atomic publish, keep-k and
the directory lock. Nothing here knows a strategy or a process group."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
from typing import Any

import torch

from sharded_exp.errors import ConfigError, is_no_space, no_space, writing

FORMAT = 1

FORMATS = ("dcp", "consolidated")

FILES = {
    "consolidated": ("model.pt", "optim.pt", "train.pt", "meta.json"),
    "dcp": (".metadata", "train.pt", "meta.json"),
}

META_KEYS = ("step", "strategy", "world_size", "optimizer", "model", "param_shapes")

_NAME = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit the configured job."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.fullmatch(name)
        if m and os.path.isfile(os.path.join(directory, name, "meta.json")):
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def checkpoint_format(meta: dict[str, Any]) -> str:
    return meta.get("checkpoint_format", "consolidated")  # written before dcp existed


def read_meta(path: str) -> dict[str, Any]:
    """meta.json of a checkpoint, after checking that every file is there and readable
    (tensor files memory-mapped or, for dcp, checked against its metadata: no tensor is read)."""
    meta_path = os.path.join(path, "meta.json")
    held = complete_checkpoints(path)
    if held and not os.path.isfile(meta_path):  # a directory of checkpoints, not one of them
        raise CheckpointError(
            f"{path} holds checkpoints ({', '.join(os.path.basename(p) for _, p in held)}), it is not one: "
            f"name one (the newest: {held[-1][1]}), or resume the run they belong to with trainer.resume=auto"
        )
    for name in ("meta.json", "train.pt"):  # in both formats
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {meta_path} is corrupt: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"checkpoint {meta_path} has format {found!r}; this version reads {FORMAT}")
    missing = [k for k in META_KEYS if k not in meta]
    fmt = checkpoint_format(meta)
    wrong = [k for k, ok in _meta_types(meta).items() if not ok]
    if missing or wrong or fmt not in FORMATS:
        raise CheckpointError(
            f"checkpoint file {meta_path} is corrupt: "
            + (f"keys missing: {', '.join(missing)}" if missing else f"wrong type or value: {', '.join(wrong)}")
        )
    for name in FILES[fmt]:
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    tensor_files = ("model.pt", "optim.pt", "train.pt") if fmt == "consolidated" else ("train.pt",)
    for name in tensor_files:
        content = load_file(os.path.join(path, name))  # memory-mapped: cheap, and catches truncation
        what = _holds(name, content, meta)
        if what:
            raise CheckpointError(f"checkpoint file {os.path.join(path, name)} is corrupt: {what}")
    if fmt == "dcp":
        _check_dcp_files(path, meta)
    return meta


def _meta_types(meta: dict[str, Any]) -> dict[str, bool]:
    """Each meta.json key that is there: is its value of the right kind?"""
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    checks = {
        "step": lambda v: is_int(v) and v >= 0,
        "world_size": lambda v: is_int(v) and v >= 1,
        "strategy": lambda v: isinstance(v, str),
        "optimizer": lambda v: isinstance(v, str),
        "model": lambda v: isinstance(v, (dict, str)),
        "param_shapes": lambda v: (
            isinstance(v, dict)
            and all(isinstance(s, list) and all(is_int(d) and d >= 0 for d in s) for s in v.values())
        ),
    }
    return {k: check(meta[k]) for k, check in checks.items() if k in meta}


def _holds(name: str, content: Any, meta: dict[str, Any]) -> str | None:
    """Why a checkpoint file does not hold what its name says (e.g. two files swapped), or None."""
    if name == "model.pt":
        if not isinstance(content, dict) or not all(torch.is_tensor(v) for v in content.values()):
            return "it does not hold a model state dict (tensors by name)"
        if set(content) != set(meta["param_shapes"]):
            return "its tensors are not the ones meta.json names (files swapped or from another checkpoint?)"
    elif name == "optim.pt":
        if (
            not isinstance(content, dict)
            or not isinstance(content.get("state"), dict)
            or not isinstance(content.get("param_groups"), list)
        ):
            return "it does not hold an optimizer state (state and param_groups)"
    elif name == "train.pt":
        if not isinstance(content, dict) or not {"scaler", "rng", "param_groups"} <= set(content):
            return "it does not hold the training state (scaler, rng, param_groups)"
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a dcp ``.metadata`` file, refusing every class but the metadata's own: DCP
    reads it with plain ``pickle``, which runs whatever a planted file names; here nothing
    runs in the parent before the checkpoint is refused."""

    TORCH = {
        "Size",
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "strided",
        "sparse_coo",
        "contiguous_format",
        "channels_last",
        "preserve_format",
    }
    BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "slice"}

    def find_class(self, module: str, name: str):
        if "." in name:  # pickle resolves a dotted name attribute by attribute: any module's os.system
            raise pickle.UnpicklingError(f"{module}.{name} is not a part of dcp's metadata (refused: not unpickled)")
        if module == "torch.distributed.checkpoint.metadata":  # its classes: plain records of shapes and offsets
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif (
            (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")  # a file's byte range
            or (module == "torch" and name in self.TORCH)
            or (module == "builtins" and name in self.BUILTINS)
            or (module == "collections" and name == "OrderedDict")
            or (module == "torch.serialization" and name == "_get_layout")  # how torch pickles a layout
            or (module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a part of dcp's metadata (refused: not unpickled)")


def read_dcp_metadata(path: str):
    """A dcp checkpoint's ``.metadata``, unpickled by :class:`_MetadataUnpickler`."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return _MetadataUnpickler(f).load()


def _check_dcp_files(path: str, meta: dict[str, Any]) -> None:
    """The dcp metadata is readable, names the shapes meta.json names, and every byte range
    it points at exists on disk (catches truncated and missing shard files)."""
    from torch.distributed.checkpoint.metadata import (
        TensorStorageMetadata,  # lazy: torch.distributed.checkpoint, which a job that saves and loads none never needs
    )

    try:
        metadata = read_dcp_metadata(path)
    except Exception as exc:  # noqa: BLE001 -- any failure to read is a corrupt file
        raise CheckpointError(
            f"checkpoint file {os.path.join(path, '.metadata')} is corrupt or unreadable: {exc}"
        ) from None
    # DCP reads a non-tensor entry back with torch.load(weights_only=False); ours hold tensors only
    pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata))
    if pickled:
        raise CheckpointError(
            f"checkpoint {path} holds non-tensor entries ({', '.join(pickled[:3])}), which DCP would unpickle "
            "unrestricted; sharded_exp's dcp checkpoints hold tensors only: refused, nothing loaded"
        )
    shapes = {
        k[len("model.") :]: list(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")
    }
    if shapes != {k: list(v) for k, v in meta["param_shapes"].items()}:
        raise CheckpointError(f"checkpoint {path}: .metadata and meta.json disagree on the model's shapes")
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) < end:
            raise CheckpointError(f"checkpoint file {file} is missing or truncated (dcp metadata expects {end} bytes)")


def load_file(file: str) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 -- any failure to read is a corrupt file
        raise CheckpointError(f"checkpoint file {file} is corrupt or unreadable: {exc}") from None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj: Any, file: str) -> None:
    try:
        with open(file, "wb") as f:
            if file.endswith(".json"):
                f.write(json.dumps(obj, indent=2).encode())
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as exc:
        if is_no_space(exc, file):
            raise no_space(file) from None
        raise


@contextlib.contextmanager
def removed_on_failure(tmp: str):
    """A checkpoint's temporary directory goes if writing it fails (a full disk): the
    previous checkpoints stay as they were."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: str, path: str, meta: dict[str, Any], keep: int = 0) -> None:
    """meta.json last (its presence marks completeness), fsync, then the atomic rename; then
    only the newest ``keep`` checkpoints of the directory stay (0: all)."""
    directory = os.path.dirname(path)
    save_file(meta, os.path.join(tmp, "meta.json"))
    fsync_dir(tmp)
    os.rename(tmp, path)  # atomic: the checkpoint appears complete or not at all
    fsync_dir(directory)
    if keep > 0:
        for _, old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def hold_directory(directory: str, refusal):
    """Hold ``directory`` for this process (an exclusive lock on ``<directory>/.lock``, which
    names our pid; released when the process ends, however it ends). Held by another live
    process: ``refusal(owner pid)`` is raised at once."""
    import fcntl  # lazy: POSIX only; the module imports on a system without it

    f = open(os.path.join(directory, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        raise refusal(owner) from None
    with writing(f.name):
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    return f


def remove_unfinished_saves(directory: str) -> list[str]:
    """Remove the ``.step_<n>.tmp.<job>`` directories of saves that never finished (a job killed
    while writing): called by the job that holds ``directory``, so no live save is among them.
    Returns what was removed."""
    removed = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if re.fullmatch(r"\.step_\d+\.tmp\..+", name) and os.path.isdir(os.path.join(directory, name)):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
                removed.append(os.path.join(directory, name))
    return removed


def hold_checkpoint_dir(directory: str):
    """Hold ``trainer.checkpoint_dir`` as the run directory is held: two live jobs never
    write checkpoints into one directory (the second is refused before its ranks start)."""
    try:
        os.makedirs(directory, exist_ok=True)
        return hold_directory(
            directory,
            lambda owner: ConfigError(
                f"trainer.checkpoint_dir={directory} is in use by a running job (pid {owner}); wait for it to end "
                "or choose another trainer.checkpoint_dir"
            ),
        )
    except OSError as exc:
        raise ConfigError(
            f"trainer.checkpoint_dir={directory} cannot be written ({exc.strerror or exc}); "
            "choose another trainer.checkpoint_dir"
        ) from None


def next_numbered(parent: str) -> str:
    """A new directory ``<parent>/<n>``, n the next number after the highest: one deleted
    by hand leaves a gap, not a clash."""
    os.makedirs(parent, exist_ok=True)
    taken = [int(n) for n in os.listdir(parent) if n.isdigit()]
    target = os.path.join(parent, str(max(taken, default=0) + 1))
    os.makedirs(target)
    return target
