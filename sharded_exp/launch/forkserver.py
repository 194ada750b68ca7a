"""The forkserver that rank processes are forked from, started as early as possible.

Rank processes fork from a clean server process that imported torch and sharded_exp once
(plain fork would inherit the parent's OpenMP pool and deadlock; CUDA cannot be forked
after initialisation). Importing takes seconds, so ``python -m sharded_exp`` starts the
server before it imports anything heavy itself: both import in parallel. This module
imports only the standard library for that reason.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from sharded_exp.errors import ConfigError
from sharded_exp.launch.layout import will_spawn

PRELOAD = [
    "sharded_exp.launch.server_init",
    "sharded_exp.train.trainer",
    "sharded_exp.strategies",
    "torch._dynamo",
]
"""Imported once by the server: its signal settings, the trainer, every strategy, and
torch._dynamo, which DistributedDataParallel would otherwise import in every rank (about a
second each) and the parent's pre-flight check needs for its fake step. Not torchmetrics:
the evaluation pass computes its definitions in plain torch (train/evaluate.py). The server
serves no fork until all of it is imported: what only some jobs need is in
:data:`STRATEGY_MODULES` and :data:`HF_MODELING`."""

STRATEGY_MODULES = {"zero1": "torch.distributed.optim"}
"""Modules a strategy imports when it builds, preloaded when the command line names it
(``strategy=zero1``, a sweep over it, a glob) or a preset that sweeps strategies
(``experiment=...``, ``hparams_search=...``): zero1's 0.2 s, which every other job's first
step would otherwise wait for."""


HF_MODELING = {
    "hf_bert": "transformers.models.bert.modeling_bert",
    "hf_gpt2": "transformers.models.gpt2.modeling_gpt2",
    "hf_llama": "transformers.models.llama.modeling_llama",
}
"""Hugging Face modeling modules by model option prefix: several seconds of imports that the
server does while the parent composes and checks the config, not every rank after it."""


def extra_preload(args: list[str]) -> list[str]:
    """Modules the chosen model and strategies need, read from the command line
    (``model=hf_bert...``, ``strategy=zero1``, ``strategy=ddp,zero1``)."""
    modules = []
    for arg in args:
        key, _, value = arg.partition("=")
        key = key.lstrip("+")
        if key == "model":
            modules += [module for prefix, module in HF_MODELING.items() if value.startswith(prefix)]
        elif key == "strategy":
            every = "*" in value or "glob(" in value
            modules += [module for name, module in STRATEGY_MODULES.items() if every or name in value]
        elif key in ("experiment", "hparams_search"):  # presets that sweep the strategies
            modules += list(STRATEGY_MODULES.values())
    return list(dict.fromkeys(modules))


def context(extra: list[str] | None = None) -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + list(extra or []))  # a module that fails to import is skipped
    return ctx


_started_early = False


def start_early(args: list[str] | None = None) -> None:
    """Start the server now (it imports in the background) if this job will spawn ranks."""
    global _started_early
    if will_spawn():
        context(extra_preload(args or []))
        multiprocessing.forkserver.ensure_running()
        atexit.register(stop)
        _started_early = True


def started_early() -> bool:
    """Whether this process's command started the server before its own imports
    (``python -m sharded_exp``; not a library call or a test, whose process has imported
    what the server has)."""
    return _started_early


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run in a process forked from the server, which has imported torch and
    sharded_exp already; its return value, or its exception raised here.

    ``fn``, ``args`` and what ``fn`` returns or raises travel pickled. An exception that
    cannot be pickled, or unpickled, comes back as a RuntimeError with its type and message; every exception but a
    ConfigError (whose message is the whole answer) carries the other process's traceback
    as a note. Interrupted here (Ctrl-C), the other process is killed, not left running.
    """
    call = Call(fn.__qualname__)
    call.begin(fn, args)
    return call.result()


def start(fn: Callable[..., Any], *args: Any, answers: int = 1) -> Call:
    """:func:`call`, begun: ``fn(*args)`` runs in the other process while this one goes on
    (the parent imports torch while the server checks its config); ``.result()`` waits.
    The server forks nothing until it has imported what it preloads: the process is asked
    for from a thread, so that this one is not held up meanwhile. ``answers`` above 1: ``fn``
    is a generator that yields at most that many answers, each sent as soon as it is yielded
    and read by one ``.result()`` each, in order (the config checked, then the peak predicted);
    a caller that needs fewer (the first answer was the whole of it) cancels the call."""
    call = Call(fn.__qualname__, answers)
    call.thread = threading.Thread(target=call.begin, args=(fn, args), name="forkserver-call", daemon=True)
    call.thread.start()
    return call


class Call:
    """A function running in a process forked from the server (:func:`start`)."""

    def __init__(self, name: str, answers: int = 1):
        self.name = name
        self.left = answers
        """Answers not yet read (:meth:`result`)."""
        self.started = time.time()
        """When it was begun (time.time())."""
        self.proc = self.reader = self.thread = None
        self.failed: BaseException | None = None
        """Why the process could not be started (an argument that cannot be pickled, say)."""
        self.cancelled = False
        self.lock = threading.Lock()

    def begin(self, fn: Callable[..., Any], args: tuple) -> None:
        """Start the process (it waits for the server's imports); a failure is kept for :meth:`result`."""
        reader = writer = None
        try:
            ctx = multiprocessing.get_context("forkserver")
            reader, writer = ctx.Pipe(duplex=False)
            # not daemonic: fn may start processes of its own (measuring the this profile does); it is
            # killed if it outlives the call, and watches this process (watch_parent)
            proc = ctx.Process(target=_answer, args=(writer, fn, args, os.getpid()))
            proc.start()
            writer.close()  # only the child writes: its death then ends the read (EOFError)
        except BaseException as exc:  # noqa: BLE001 -- raised by result(), in the caller's thread
            for end in (reader, writer):
                if end is not None:
                    end.close()
            self.failed = exc
            return
        with self.lock:
            self.proc, self.reader = proc, reader
            cancelled = self.cancelled
        if cancelled:  # cancelled while the server was still importing
            self._stop()

    def cancel(self) -> None:
        """Stop waiting for it: the process is killed if it runs, or as soon as it starts
        (without waiting here for the server's imports)."""
        with self.lock:
            self.cancelled = True
            started = self.proc is not None
        if started:
            self._stop()

    def kill(self) -> None:
        """Kill the process, if it runs, leaving the pipe to its reader: a :meth:`result` waiting
        now ends at once ("died before answering"). Safe in a signal handler."""
        proc = self.proc
        if proc is not None and proc.is_alive():
            proc.kill()

    def _stop(self) -> None:
        self.reader.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()

    def _started(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.failed is not None:
            raise self.failed

    def result(self) -> Any:
        """Wait for the next answer: the function's return value (or what it yields next), or
        its exception raised here. After the last answer, or an exception, the process is gone."""
        self._started()
        last = True
        try:
            try:
                payload = self.reader.recv_bytes()
            except EOFError:
                self.proc.join()
                raise RuntimeError(
                    f"the process forked to run {self.name} died before answering (exit code {self.proc.exitcode})"
                ) from None
            ok, value = pickle.loads(payload)  # the answer's classes are imported here, once it has come
            self.left -= 1
            last = not ok or self.left <= 0
            if last:
                self.proc.join()
        finally:
            if last:
                self.reader.close()
                if self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join()
        if ok:
            return value
        raise value


def _answer(writer, fn: Callable[..., Any], args: tuple, caller: int) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the server ignores it (server_init); the caller does not
    watch_parent(caller)
    for answer in _answers(fn, args):  # a generator may answer fewer times than asked: the reader gets EOF
        if not _send(writer, fn, answer):
            break  # an exception sent: nothing follows it
    writer.close()


def _answers(fn: Callable[..., Any], args: tuple):
    """What ``fn(*args)`` answers, each as (ok, value): its return value, or each value it
    yields where it is a generator; an exception ends them, as (False, exc)."""
    try:
        value = fn(*args)
        if not inspect.isgenerator(value):
            yield True, value
            return
        for each in value:
            yield True, each
    except BaseException as exc:  # noqa: BLE001 -- every failure goes back to the caller
        if not isinstance(exc, ConfigError):
            exc.add_note("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        yield False, exc


def _send(writer, fn: Callable[..., Any], answer: tuple) -> bool:
    """Send one (ok, value) answer; whether it went as a value (False: an exception went)."""
    try:
        payload = pickle.dumps(answer)
        pickle.loads(payload)  # an exception whose __init__ wants other arguments pickles but does not load
    except Exception:  # noqa: BLE001 -- an exception (or a value) that does not travel
        exc = answer[1] if not answer[0] else TypeError(f"{fn.__qualname__} returned a value that cannot be pickled")
        plain = RuntimeError(f"{type(exc).__name__}: {exc}")
        plain.__notes__ = list(getattr(exc, "__notes__", []))
        answer, payload = (False, plain), pickle.dumps((False, plain))
    writer.send_bytes(payload)
    return answer[0]


def watch_parent(pid: int, period_s: float = 1.0) -> None:
    """Exit this process within ``period_s`` of process ``pid``'s death (the job's parent,
    killed by a signal it cannot pass on): nobody waits for this process's work any more. A
    daemon thread; a process forked from the server has the server for its parent, so the
    kernel's parent-death signal would not see the job's parent go."""

    def watch() -> None:
        while _alive(pid):
            time.sleep(period_s)
        logging.getLogger(__name__).error("the job's parent process (pid %d) is gone; exiting", pid)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone too
    except OSError:
        return True


def stop() -> None:
    """End the server with the job. Left to itself it would exit once the job's process is
    gone, through a full interpreter teardown of everything it preloaded (over a second),
    holding the job's stdout and stderr open all the while: a caller reading them (a
    pipe, ``tee``, CI, ``subprocess.run``) would wait that long for the job to end. The
    server holds no state worth a teardown; the ranks it forked have ended by now. SIGKILL:
    the server ignores SIGTERM (:mod:`.server_init`: it must outlive one sent to the job's
    whole process group)."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
