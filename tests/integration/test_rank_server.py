"""sharded_exp.launch.forkserver.call: a function run in a process forked from the rank
server (the pre-flight check's way), its answer or its failure brought back as the caller
would have had it in-process. Real processes (this test process's server); the functions
here are module-level so that they travel by name."""

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


def checked_then_predicted(refuse_second: bool):
    """The pre-flight check's two answers, as :mod:`sharded_exp.launch.server_check` gives them."""
    yield "config checked", os.getpid()
    if refuse_second:
        raise ConfigError("the job needs about 9,999 MiB of host memory")
    yield "peak predicted", os.getpid()


class TwoArgumentError(Exception):
    def __init__(self, path, why):
        super().__init__(f"{path}: {why}")


def raise_two_argument_error():
    raise TwoArgumentError("data.path", "no such file")


def start_a_process():
    """What measuring the this profile does from inside the check: a process of its own."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()
    return proc.exitcode


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


def test_an_exception_that_pickles_but_does_not_load_comes_back_as_its_message():
    with pytest.raises(RuntimeError, match=r"^TwoArgumentError: data.path: no such file") as caught:
        forkserver.call(raise_two_argument_error)
    assert str(caught.value) == "TwoArgumentError: data.path: no such file"
    assert "in raise_two_argument_error" in caught.value.__notes__[0]  # where it was raised, kept


def test_the_called_function_may_start_processes_of_its_own():
    assert forkserver.call(start_a_process) == 0  # a daemonic process may not


def test_a_generator_answers_each_value_as_it_is_yielded_and_the_process_ends_after_the_last():
    call = forkserver.start(checked_then_predicted, False, answers=2)
    (first, pid), (second, same) = call.result(), call.result()
    assert (first, second) == ("config checked", "peak predicted") and pid == same != os.getpid()
    assert not call.proc.is_alive() and call.reader.closed


def test_a_generator_that_raises_after_its_first_answer_raises_at_the_second_read():
    call = forkserver.start(checked_then_predicted, True, answers=2)
    assert call.result()[0] == "config checked"
    assert not call.reader.closed  # the first read leaves the pipe open for the second
    with pytest.raises(ConfigError, match="9,999 MiB of host memory"):
        call.result()
    assert not call.proc.is_alive() and call.reader.closed
