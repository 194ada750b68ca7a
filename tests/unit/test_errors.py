"""sharded_exp.errors: recognising an out-of-memory error, the ConfigError family, missing
packages, and naming the file when a write fails for lack of space."""

from __future__ import annotations

import errno

import pytest

from sharded_exp.errors import (
    OOM_SIGNS,
    ConfigError,
    NothingToDo,
    RunDirInUse,
    WontFit,
    is_no_space,
    is_oom,
    missing_packages,
    no_space,
    writing,
)


@pytest.mark.parametrize("sign", OOM_SIGNS)
def test_every_oom_sign_in_a_message_is_an_oom(sign):
    assert is_oom(RuntimeError(f"step 3: {sign} (tried to allocate 2 GiB)"))


def test_the_exception_type_name_alone_marks_an_oom():
    class OutOfMemoryError(RuntimeError):
        pass

    assert is_oom(OutOfMemoryError("tried to allocate 20.00 MiB"))


@pytest.mark.parametrize("exc", [RuntimeError("shape mismatch"), ValueError("out of range"), MemoryError("")])
def test_other_errors_are_not_ooms(exc):
    assert not is_oom(exc)


def test_config_errors_are_value_errors_and_their_kinds_are_config_errors():
    assert issubclass(ConfigError, ValueError)
    for kind in (NothingToDo, WontFit, RunDirInUse):
        assert issubclass(kind, ConfigError)


def test_missing_packages_names_only_those_that_cannot_be_imported():
    assert missing_packages(["json", "no_such_package_xyz", "os.path", "no_such_pkg_abc.sub"]) == [
        "no_such_package_xyz",
        "no_such_pkg_abc.sub",
    ]
    assert missing_packages([]) == []


def test_no_space_is_enospc_naming_the_file():
    exc = no_space("/data/model.pt")
    assert exc.errno == errno.ENOSPC and str(exc).endswith("no space left on device while writing /data/model.pt")


def test_is_no_space_by_errno_or_by_the_free_space_left(tmp_path, monkeypatch):
    import shutil

    file = str(tmp_path / "f")
    assert is_no_space(OSError(errno.ENOSPC, "full"), file)
    assert not is_no_space(OSError(errno.EACCES, "denied"), file)  # tmp_path has space

    class Usage:
        free = 2**20 - 1

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage)
    assert is_no_space(RuntimeError("unexpected pos 123"), file)  # torch.save's full disk
    Usage.free = 2**20
    assert not is_no_space(RuntimeError("unexpected pos 123"), file)


def test_is_no_space_without_a_readable_filesystem_is_false(monkeypatch):
    import shutil

    def broken(path):
        raise OSError("gone")

    monkeypatch.setattr(shutil, "disk_usage", broken)
    assert not is_no_space(RuntimeError("x"), "/nowhere/f")


def test_writing_turns_a_full_disk_into_an_error_naming_the_file(tmp_path):
    file = str(tmp_path / "ckpt.pt")
    with pytest.raises(OSError, match=f"no space left on device while writing {file}") as err:
        with writing(file):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.errno == errno.ENOSPC and err.value.__cause__ is None


def test_writing_lets_other_errors_through_unchanged(tmp_path):
    with pytest.raises(PermissionError, match="denied"):
        with writing(str(tmp_path / "f")):
            raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(KeyError):
        with writing(str(tmp_path / "f")):
            raise KeyError("k")
    with writing(str(tmp_path / "f")) as w:
        assert w.file == str(tmp_path / "f")
