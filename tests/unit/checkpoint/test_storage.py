"""sharded_exp.checkpoint.storage: checkpoint names, discovery of complete checkpoints, meta.json
and file validation, the atomic publish with keep-k, unfinished-save cleanup, numbered archive
directories, the restricted .metadata unpickler and the directory lock."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch

from sharded_exp.checkpoint import storage
from sharded_exp.checkpoint.storage import (
    CheckpointError,
    checkpoint_format,
    complete_checkpoints,
    hold_checkpoint_dir,
    next_numbered,
    publish,
    read_meta,
    remove_unfinished_saves,
    removed_on_failure,
    save_file,
    step_name,
)
from sharded_exp.errors import ConfigError


# ------------------------------------------------------------------------------ names
def test_step_name_pads_the_step_to_eight_digits():
    assert step_name(10) == "step_00000010"
    assert step_name(0) == "step_00000000"
    assert step_name(12345678) == "step_12345678"


def test_step_names_sort_as_their_steps_do():
    steps = [9, 10, 100, 2, 35]
    assert sorted(step_name(s) for s in steps) == [step_name(s) for s in sorted(steps)]


# -------------------------------------------------------------------------- discovery
def test_complete_checkpoints_of_a_missing_directory_is_empty(tmp_path):
    assert complete_checkpoints(str(tmp_path / "nowhere")) == []


def test_complete_checkpoints_are_ordered_by_step_number_not_by_name(tmp_path, write_checkpoint):
    # unpadded names: by name step_10 < step_9; by number 9 < 10
    write_checkpoint(tmp_path, 10, name="step_10")
    write_checkpoint(tmp_path, 9, name="step_9")
    write_checkpoint(tmp_path, 100)
    assert complete_checkpoints(str(tmp_path)) == [
        (9, str(tmp_path / "step_9")),
        (10, str(tmp_path / "step_10")),
        (100, str(tmp_path / "step_00000100")),
    ]


def test_complete_checkpoints_ignore_unfinished_and_foreign_directories(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path, 5)
    (tmp_path / "step_00000010").mkdir()  # no meta.json: not complete
    write_checkpoint(tmp_path, 15, name=".step_00000015.tmp.123-456")  # a save in flight
    write_checkpoint(tmp_path, 20, name="step_00000020.bak")  # not a step name
    write_checkpoint(tmp_path, 25, name="archived_step_00000025")
    assert complete_checkpoints(str(tmp_path)) == [(5, str(tmp_path / "step_00000005"))]


def test_checkpoint_format_defaults_to_consolidated_for_old_checkpoints():
    assert checkpoint_format({"step": 3}) == "consolidated"
    assert checkpoint_format({"checkpoint_format": "dcp"}) == "dcp"


# ------------------------------------------------------------------------- read_meta
def test_read_meta_returns_the_meta_of_a_valid_checkpoint(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7, world_size=3)
    meta = read_meta(path)
    assert meta["step"] == 7 and meta["world_size"] == 3 and meta["param_shapes"] == {"w": [2, 3]}


@pytest.mark.parametrize("missing", ["meta.json", "train.pt", "model.pt", "optim.pt"])
def test_read_meta_names_a_missing_file(tmp_path, write_checkpoint, missing):
    path = write_checkpoint(tmp_path, 7)
    os.remove(os.path.join(path, missing))
    with pytest.raises(CheckpointError, match=f"incomplete: {missing} is missing"):
        read_meta(path)


def test_a_directory_of_checkpoints_is_named_as_one_and_its_checkpoints_offered(tmp_path, write_checkpoint):
    """trainer.resume=<the checkpoints directory>: not "incomplete", but what it holds and how
    to resume from it."""
    for step in (2, 8):
        write_checkpoint(tmp_path, step)
    with pytest.raises(CheckpointError) as refused:
        read_meta(str(tmp_path))
    assert str(refused.value) == (
        f"{tmp_path} holds checkpoints (step_00000002, step_00000008), it is not one: name one (the newest: "
        f"{tmp_path / 'step_00000008'}), or resume the run they belong to with trainer.resume=auto"
    )


def test_read_meta_requires_the_dcp_metadata_file_only_in_dcp_format(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7, checkpoint_format="dcp")
    with pytest.raises(CheckpointError, match=r"incomplete: \.metadata is missing"):
        read_meta(path)


def test_read_meta_names_unparsable_json_as_corrupt(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write('{"step": 7,')
    with pytest.raises(CheckpointError, match="meta.json is corrupt"):
        read_meta(path)


@pytest.mark.parametrize("fmt", [2, 0, None])
def test_read_meta_refuses_another_format_version(tmp_path, write_checkpoint, fmt):
    path = write_checkpoint(tmp_path, 7, format=fmt)
    with pytest.raises(CheckpointError, match=f"has format {fmt!r}; this version reads 1"):
        read_meta(path)


def test_read_meta_refuses_a_meta_that_is_not_an_object(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(CheckpointError, match="has format 'list'"):
        read_meta(path)


def _set_meta(path: str, **values) -> None:
    """Rewrite meta.json of the checkpoint at ``path`` with ``values`` in place."""
    file = os.path.join(path, "meta.json")
    with open(file) as f:
        meta = json.load(f)
    meta.update(values)
    with open(file, "w") as f:
        json.dump(meta, f)


def test_read_meta_lists_every_missing_key(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    del meta["optimizer"], meta["param_shapes"]
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointError, match="keys missing: optimizer, param_shapes"):
        read_meta(path)


@pytest.mark.parametrize(
    "key, value",
    [
        ("step", -1),
        ("step", True),  # a bool is not a step
        ("step", 3.0),
        ("world_size", 0),
        ("strategy", 1),
        ("optimizer", None),
        ("model", 5),
        ("param_shapes", {"w": [2, -3]}),
        ("param_shapes", {"w": "2x3"}),
        ("param_shapes", [[2, 3]]),
    ],
)
def test_read_meta_names_a_value_of_the_wrong_kind(tmp_path, write_checkpoint, key, value):
    path = write_checkpoint(tmp_path, 7)
    _set_meta(path, **{key: value})
    with pytest.raises(CheckpointError, match=f"wrong type or value: {key}"):
        read_meta(path)


@pytest.mark.parametrize("key, value", [("step", 0), ("world_size", 1), ("model", "mlp")])
def test_read_meta_accepts_the_smallest_valid_values(tmp_path, write_checkpoint, key, value):
    path = write_checkpoint(tmp_path, 5)
    _set_meta(path, **{key: value})
    assert read_meta(path)[key] == value


def test_read_meta_refuses_an_unknown_checkpoint_format(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7, checkpoint_format="zip")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_meta(path)


def test_read_meta_catches_model_and_optim_files_swapped(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    model, optim = os.path.join(path, "model.pt"), os.path.join(path, "optim.pt")
    os.rename(model, model + ".x")
    os.rename(optim, model)
    os.rename(model + ".x", optim)
    with pytest.raises(CheckpointError, match="model.pt is corrupt: it does not hold a model state dict"):
        read_meta(path)


def test_read_meta_catches_a_model_file_of_other_tensors(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    torch.save({"v": torch.zeros(2, 3)}, os.path.join(path, "model.pt"))
    with pytest.raises(CheckpointError, match="its tensors are not the ones meta.json names"):
        read_meta(path)


def test_read_meta_catches_an_optimizer_file_without_param_groups(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    torch.save({"state": {}}, os.path.join(path, "optim.pt"))
    with pytest.raises(CheckpointError, match="optim.pt is corrupt: it does not hold an optimizer state"):
        read_meta(path)


def test_read_meta_catches_a_training_state_without_rng(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    torch.save({"scaler": {}, "param_groups": []}, os.path.join(path, "train.pt"))
    with pytest.raises(CheckpointError, match="train.pt is corrupt: it does not hold the training state"):
        read_meta(path)


def test_read_meta_names_a_truncated_tensor_file(tmp_path, write_checkpoint):
    path = write_checkpoint(tmp_path, 7)
    file = os.path.join(path, "optim.pt")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="optim.pt is corrupt or unreadable"):
        read_meta(path)


# ------------------------------------------------------------------------ dcp files
def _dcp_checkpoint(tmp_path, write_checkpoint, shapes=None):
    """A dcp checkpoint of one tensor ``w`` (2x3), written without a process group."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path = write_checkpoint(tmp_path, 4, checkpoint_format="dcp", param_shapes=shapes or {"w": [2, 3]})
    os.remove(os.path.join(path, "model.pt"))
    os.remove(os.path.join(path, "optim.pt"))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=path, no_dist=True)
    return path


def test_read_meta_accepts_a_dcp_checkpoint_whose_metadata_agrees(tmp_path, write_checkpoint):
    assert read_meta(_dcp_checkpoint(tmp_path, write_checkpoint))["checkpoint_format"] == "dcp"


def test_read_meta_refuses_dcp_metadata_with_other_shapes(tmp_path, write_checkpoint):
    path = _dcp_checkpoint(tmp_path, write_checkpoint, shapes={"w": [3, 2]})
    with pytest.raises(CheckpointError, match=".metadata and meta.json disagree"):
        read_meta(path)


def test_read_meta_names_a_truncated_dcp_shard_file(tmp_path, write_checkpoint):
    path = _dcp_checkpoint(tmp_path, write_checkpoint)
    shard = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    size = os.path.getsize(os.path.join(path, shard))
    with open(os.path.join(path, shard), "r+b") as f:
        f.truncate(size - 1)  # one byte short of what the metadata points at
    with pytest.raises(CheckpointError, match=f"{shard} is missing or truncated"):
        read_meta(path)


class _Planted:
    def __reduce__(self):
        return (os.system, ("true",))


def test_the_metadata_unpickler_refuses_a_class_outside_dcps_metadata():
    data = pickle.dumps(_Planted())
    with pytest.raises(pickle.UnpicklingError, match="is not a part of dcp's metadata"):
        storage._MetadataUnpickler(io.BytesIO(data)).load()


def _global(module: str, name: str) -> bytes:
    """A pickle that loads the global ``module.name`` (protocol 0's GLOBAL opcode)."""
    return f"c{module}\n{name}\n.".encode()


def test_the_metadata_unpickler_loads_dcps_own_metadata_classes():
    from torch.distributed.checkpoint.metadata import Metadata

    module = "torch.distributed.checkpoint.metadata"
    assert storage._MetadataUnpickler(io.BytesIO(_global(module, "Metadata"))).load() is Metadata


@pytest.mark.parametrize(
    "module, name",
    [
        ("torch.distributed.checkpoint.metadata", "Enum"),  # imported there, not its own
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),  # dotted: attribute by attribute
        ("torch", "load"),
        ("builtins", "eval"),
        ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ],
)
def test_the_metadata_unpickler_refuses_everything_else(module, name):
    with pytest.raises(pickle.UnpicklingError, match=f"{module}.{name} is not a part of dcp's metadata"):
        storage._MetadataUnpickler(io.BytesIO(_global(module, name))).load()


def test_the_metadata_unpickler_accepts_torch_sizes_and_plain_containers():
    value = {"size": torch.Size([2, 3]), "items": [(1, 2)], "dtype": torch.float32}
    assert storage._MetadataUnpickler(io.BytesIO(pickle.dumps(value))).load() == value


# ------------------------------------------------------------------ writing, publish
def test_save_file_writes_json_for_json_names_and_torch_otherwise(tmp_path):
    save_file({"a": 1}, str(tmp_path / "m.json"))
    save_file({"t": torch.ones(2)}, str(tmp_path / "t.pt"))
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1}
    assert torch.equal(torch.load(tmp_path / "t.pt", weights_only=True)["t"], torch.ones(2))


def test_save_file_names_the_file_when_the_disk_is_full(tmp_path, monkeypatch):
    import errno

    def full(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    file = str(tmp_path / "model.pt")
    with pytest.raises(OSError, match=f"no space left on device while writing {file}") as caught:
        save_file({}, file)
    assert caught.value.errno == errno.ENOSPC


def test_removed_on_failure_removes_the_temporary_directory_and_reraises(tmp_path):
    tmp = tmp_path / ".step_00000001.tmp.x"
    tmp.mkdir()
    (tmp / "model.pt").write_bytes(b"half")
    with pytest.raises(RuntimeError, match="disk"):
        with removed_on_failure(str(tmp)):
            raise RuntimeError("disk")
    assert not tmp.exists()


def test_removed_on_failure_keeps_the_directory_on_success(tmp_path):
    tmp = tmp_path / ".step_00000001.tmp.x"
    tmp.mkdir()
    with removed_on_failure(str(tmp)):
        pass
    assert tmp.is_dir()


def _publish_step(directory, step: int, keep: int = 0) -> str:
    tmp = os.path.join(directory, f".{step_name(step)}.tmp.job")
    os.makedirs(tmp)
    path = os.path.join(directory, step_name(step))
    publish(tmp, path, {"step": step}, keep)
    return path


def test_publish_writes_meta_json_and_renames_the_temporary_directory(tmp_path):
    path = _publish_step(str(tmp_path), 3)
    assert json.loads(open(os.path.join(path, "meta.json")).read()) == {"step": 3}
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]  # no .tmp left
    assert complete_checkpoints(str(tmp_path)) == [(3, path)]


def test_publish_keeps_only_the_newest_k_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        _publish_step(str(tmp_path), step, keep=2)
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [6, 8]


def test_publish_with_keep_zero_keeps_every_checkpoint(tmp_path):
    for step in (2, 4, 6):
        _publish_step(str(tmp_path), step, keep=0)
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [2, 4, 6]


def test_publish_with_keep_one_keeps_the_checkpoint_just_written(tmp_path):
    for step in (2, 4):
        _publish_step(str(tmp_path), step, keep=1)
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [4]


# ----------------------------------------------------------------- cleanup, numbering
def test_remove_unfinished_saves_removes_only_temporary_step_directories(tmp_path, write_checkpoint):
    write_checkpoint(tmp_path, 5)
    (tmp_path / ".step_00000010.tmp.123-456").mkdir()
    (tmp_path / ".step_00000015.tmp.other").mkdir()
    (tmp_path / ".step_00000020.tmp.file").write_text("a file, not a save")
    (tmp_path / ".lock").write_text("1\n")
    (tmp_path / ".step_x.tmp.y").mkdir()  # not a step number
    removed = remove_unfinished_saves(str(tmp_path))
    assert removed == [str(tmp_path / ".step_00000010.tmp.123-456"), str(tmp_path / ".step_00000015.tmp.other")]
    assert sorted(os.listdir(tmp_path)) == [".lock", ".step_00000020.tmp.file", ".step_x.tmp.y", "step_00000005"]


def test_remove_unfinished_saves_of_a_missing_directory_is_nothing(tmp_path):
    assert remove_unfinished_saves(str(tmp_path / "nowhere")) == []


def test_next_numbered_starts_at_one(tmp_path):
    assert next_numbered(str(tmp_path / "archived")) == str(tmp_path / "archived" / "1")
    assert (tmp_path / "archived" / "1").is_dir()


def test_next_numbered_follows_the_highest_leaving_gaps(tmp_path):
    parent = tmp_path / "archived"
    for name in ("1", "3", "notes", "10x"):
        (parent / name).mkdir(parents=True)
    assert next_numbered(str(parent)) == str(parent / "4")


# --------------------------------------------------------------------------- the lock
def test_the_checkpoint_directory_lock_names_its_pid_and_refuses_a_second_holder(tmp_path):
    directory = str(tmp_path / "ckpt")
    held = hold_checkpoint_dir(directory)  # creates the directory
    try:
        assert (tmp_path / "ckpt" / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(ConfigError, match=rf"is in use by a running job \(pid {os.getpid()}\)"):
            hold_checkpoint_dir(directory)  # another open file description: flock conflicts
    finally:
        held.close()
    again = hold_checkpoint_dir(directory)  # released: held anew
    again.close()


def test_the_lock_replaces_a_stale_pid(tmp_path):
    (tmp_path / ".lock").write_text("999999999\nleftover\n")
    held = hold_checkpoint_dir(str(tmp_path))
    try:
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    finally:
        held.close()


def test_a_checkpoint_directory_that_cannot_be_made_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot be written"):
        hold_checkpoint_dir(str(tmp_path / "file" / "ckpt"))
