"""sharded_exp.launch.forkserver.call: a function run in a process forked from the rank
server, its answer or its failure brought back as the caller would have had it in-process.
Real processes (this test process's server); the functions here are module-level so that
they travel by name."""

from __future__ import annotations

import os
import threading

import pytest

from sharded_exp.errors import ConfigError
from sharded_exp.launch import forkserver


def pid_and(value):
    return os.getpid(), value


def refuse(value):
    raise ConfigError(f"trainer.world_size={value} is not allowed")


def break_down():
    raise KeyError("a missing key, deep inside")


def die():
    os._exit(7)


def unpicklable():
    return threading.Lock()


def test_the_answer_comes_from_another_process():
    pid, value = forkserver.call(pid_and, {"a": [1, 2]})
    assert value == {"a": [1, 2]} and pid != os.getpid()


def test_a_config_error_comes_back_as_it_was_raised_with_no_traceback_note():
    with pytest.raises(ConfigError, match=r"^trainer.world_size=3 is not allowed$") as caught:
        forkserver.call(refuse, 3)
    assert not getattr(caught.value, "__notes__", None)  # its message is the whole answer


def test_any_other_failure_comes_back_with_the_other_process_traceback():
    with pytest.raises(KeyError, match="a missing key") as caught:
        forkserver.call(break_down)
    (note,) = caught.value.__notes__
    assert "in break_down" in note and note.startswith("Traceback")


def test_a_process_that_dies_without_answering_is_said_with_its_exit_code():
    with pytest.raises(RuntimeError, match=r"died before answering \(exit code 7\)"):
        forkserver.call(die)


def test_an_answer_that_cannot_travel_is_said_not_lost():
    with pytest.raises(RuntimeError, match=r"TypeError: unpicklable returned a value that cannot be pickled"):
        forkserver.call(unpicklable)


@pytest.mark.parametrize(
    "args, modules",
    [
        (["model=hf_llama"], ["transformers.models.llama.modeling_llama"]),
        (["strategy=zero1"], ["torch.distributed.optim"]),
        (["-m", "strategy=ddp,zero1"], ["torch.distributed.optim"]),
        (["-m", "strategy=glob(*)"], ["torch.distributed.optim"]),
        (["strategy=ddp", "model=mlp"], []),
    ],
)
def test_the_server_preloads_what_the_command_line_names(args, modules):
    assert forkserver.extra_preload(args) == modules
