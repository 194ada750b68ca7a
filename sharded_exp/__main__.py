"""Entry point: ``python -m sharded_exp [group=option ...] [key=value ...]`` (or ``sharded-exp``).

    python -m sharded_exp                                   # defaults: CPU, 2 ranks, MLP, DDP
    python -m sharded_exp strategy=sharded_ddp precision=16
    python -m sharded_exp model=gpt strategy=oss trainer.world_size=4
    torchrun --nproc-per-node=2 -m sharded_exp strategy=oss  # ranks from torchrun, no spawning

The Hydra job is the parent: it checks the config and starts the ranks
(:mod:`sharded_exp.launch.parent`). Output goes to the Hydra run directory (``outputs/...``).
"""

import time

STARTED = time.time()  # before the heavy imports: for the startup timeline in result.json

if __name__ == "__main__":
    import sys as _sys

    from sharded_exp.questions import is_query as _is_query
    from sharded_exp.questions import start_rank_server

    # The rank server first: its imports (torch, seconds) are the longest path to the first
    # step, and the typo check's (Hydra's, then a compose) need not come before them.
    start_rank_server(_sys.argv[1:])
    if not _is_query(_sys.argv[1:]):  # a typo is refused in a second, before torch (Hydra answers a question itself)
        from sharded_exp.spelling import refuse_misspelled

        refuse_misspelled(_sys.argv[1:], "config")

import logging
import os
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sharded_exp.compose import quote_numeric_choices, register_schemas
from sharded_exp.errors import ConfigError, NothingToDo, RunDirInUse
from sharded_exp.launch import forkserver, server_check
from sharded_exp.launch.layout import external_layout, with_shared_run_dir
from sharded_exp.questions import is_query
from sharded_exp.sweep import check_objective, objective_value, sweeper_direction
from sharded_exp.vocabulary.wandb_names import job_type, run_name, wandb_group

if TYPE_CHECKING:
    from sharded_exp.job.result import Result

register_schemas(query=True)  # the registries' schemas from their cache: no torch here
IMPORTED = time.time()
log = logging.getLogger("sharded_exp")  # __name__ is __main__ here
JOB_STARTED = False
"""Set when Hydra calls the job: an exit before it is a command-line or config mistake."""
RUN_DIR: str | None = None
"""The run directory Hydra made for this (single) job, once it is known: a stop before the
ranks start removes it where nothing was written there (:func:`remove_if_unused`)."""


class StopOutsideTheJob(BaseException):
    """SIGTERM or SIGHUP while the job's own handling is not in place (before its ranks start,
    or after it ended): said in one line like Ctrl-C's KeyboardInterrupt, not a silent death."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_outside_the_job(signum, frame) -> None:
    raise StopOutsideTheJob(signum)


def name_the_run(cfg: DictConfig) -> None:
    """Fill the tracker's group, job type and run name from Hydra, in the parent.

    Ranks have no HydraConfig, so these are resolved here: group = the sweep directory under
    -m (one group per sweep), else the run directory (:func:`~sharded_exp.vocabulary.wandb_names.wandb_group`);
    name = the overrides.
    """
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if cfg.logger.get("group", "missing") is None:
        cfg.logger.group = wandb_group(hc.sweep.dir if multirun else hc.run.dir)
    if cfg.logger.get("job_type", "missing") is None:
        cfg.logger.job_type = job_type(cfg.strategy.name)
    if cfg.logger.get("run_name", "missing") is None:
        cfg.logger.run_name = run_name(hc.job.override_dirname)


def check_resolvable(cfg: DictConfig) -> None:
    """Every value set and every interpolation resolvable (``???``, an unset
    ``${oc.env:...}``), said as one error line naming the key, before anything else."""
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            hint = " (model=custom needs model._target_=package.module.factory)" if "model._target_" in missing else ""
            data_keys = [k for k in missing if k.startswith("data.")]
            if data_keys:
                hint += f" (data={cfg.data.name} reads local files: {' '.join(k + '=...' for k in data_keys)})"
            raise ConfigError(f"{', '.join(missing)} must be set: no value was given{hint}")
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        message = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: {message}" if key else message) from None


def remove_if_unused(output_dir: str) -> None:
    """After a config error: the run directory Hydra just made, if it holds nothing but
    Hydra's empty log and our lock file, goes (an earlier run's directory is never touched)."""
    try:
        names = os.listdir(output_dir)
        unused = lambda n: n == ".lock" or n.endswith(".log") and os.path.getsize(os.path.join(output_dir, n)) == 0
        if all(unused(n) for n in names):
            for n in names:
                os.remove(os.path.join(output_dir, n))
            os.rmdir(output_dir)
            # and the directories made for it (outputs/runs/), where nothing else is in them
            parent, top = os.path.dirname(os.path.abspath(output_dir)), os.getcwd()
            while parent.startswith(top + os.sep) and not os.listdir(parent):
                os.rmdir(parent)
                parent = os.path.dirname(parent)
    except OSError:
        pass


def check_output_dirs(argv: list[str]) -> None:
    """A run or sweep directory given on the command line must be a directory this user
    can write to; said now, before Hydra makes it (Hydra would answer with a traceback)."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in ("hydra.run.dir", "hydra.sweep.dir") or not value or "${" in value:
            continue
        if os.path.exists(value) and not os.path.isdir(value):
            print(f"error: {key}={value} is a file, not a directory; choose another {key}", file=sys.stderr)
            sys.exit(2)
        existing = os.path.abspath(value)
        while not os.path.isdir(existing):  # nothing is made here: a config error leaves no directory
            if os.path.exists(existing):
                print(
                    f"error: {key}={value}: {existing} is a file, not a directory; choose another {key}",
                    file=sys.stderr,
                )
                sys.exit(2)
            existing = os.path.dirname(existing)
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as exc:
            print(f"error: {key}={value} cannot be written ({exc.strerror}); choose another {key}", file=sys.stderr)
            sys.exit(2)


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown of every imported module (torch,
    transformers, ...: most of a second, after all the work is done). Everything the job
    writes is closed by now (result.json, .hydra/, the report, W&B runs are finished);
    what is left to do is flush the log and the streams and end the rank server."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    forkserver.stop()
    os._exit(code)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One job (one sweep point). Returns the number ``objective`` names, for an optimizing
    sweeper (sharded_exp.sweep), or None."""
    global JOB_STARTED
    JOB_STARTED = True
    result = check_and_launch(cfg)
    if cfg.get("objective") is None:
        return None
    return objective_value(result.as_written() if result else {}, cfg.objective, sweeper_direction(HydraConfig.get()))


def check_and_launch(cfg: DictConfig) -> "Result | None":
    """Check and launch the job; its result (None when nothing ran). Exits on a refused
    config or a failure outside a sweep."""
    from sharded_exp.job.result import Result  # lazy: pydantic, not for Hydra's questions (--help, --cfg)
    from sharded_exp.report.sweep_points import sweep_id  # lazy: pydantic (as above)

    global RUN_DIR
    hc = HydraConfig.get()
    output_dir = hc.runtime.output_dir
    multirun = hc.mode == RunMode.MULTIRUN
    RUN_DIR = None if multirun else output_dir
    overrides = OmegaConf.to_container(hc.overrides.task, resolve=False)  # as typed: ${...} unresolved
    identity = {"overrides": overrides}
    if multirun:
        identity["sweep_id"] = sweep_id(hc.sweep.dir)
    try:
        check_resolvable(cfg)
        check_objective(cfg.get("objective"))
        name_the_run(cfg)
        # Hydra's own .hydra/ writing is off (conf/config.yaml): the launcher writes these
        # files once the config is known good, after moving an earlier attempt's aside.
        job_files = {
            "config.yaml": cfg,
            "hydra.yaml": OmegaConf.create({"hydra": hc}),
            "overrides.yaml": OmegaConf.create(overrides),
        }
        result = start_job(cfg, output_dir, job_files, identity)
    except NothingToDo as exc:  # a requeued job that had finished: result.json stays as it is
        log.info("%s", exc)
        return read_result_in(output_dir)
    except ConfigError as exc:  # raised before any rank steps (launch/parent.py)
        if not multirun:
            print(f"error: {exc}", file=sys.stderr)  # not logged: no run directory is left behind
            remove_if_unused(output_dir)
            sys.exit(2)
        if isinstance(exc, RunDirInUse):
            print(f"error: {exc}", file=sys.stderr)
            return None  # the directory is another job's: nothing is written there
        log.error("error: %s", exc)  # in the point's log, beside its result.json
        result = _record_config_error(cfg, output_dir, exc, identity=identity)
    except OSError as exc:  # a path the job reads or writes: missing, a directory, full, read-only
        message = os_error(cfg, exc)
        print(f"error: {message}; {what_ran(output_dir)}", file=sys.stderr)
        if not multirun:
            sys.exit(1)
        try:  # a sweep point still ends with a result.json, and the report counts it
            result = _record_config_error(cfg, output_dir, OSError(message), identity=identity)
        except OSError as written:  # the run directory's own filesystem: nothing can be written there
            from sharded_exp.report.command import ReportCallback  # lazy: torch, not for Hydra's questions

            print(f"error: {output_dir}/result.json not written ({written.strerror or written})", file=sys.stderr)
            ReportCallback.failed_points += 1  # no row in the report: counted here, so the sweep exits 1
            return Result.build(status="failed", error=message)  # not written: what the objective reads
    except Exception as exc:  # noqa: BLE001 -- unforeseen, before or around the ranks
        if not multirun:
            raise  # its traceback is what a bug report needs
        # A sweep point still ends with a result.json, and the sweep (and its report) go on.
        log.error("error: %s: %s", type(exc).__name__, exc)
        result = _record_config_error(cfg, output_dir, exc, what="unexpected", identity=identity)
    if result.status == "stopped":
        # SIGTERM/SIGINT: exit like a terminated process (143 / 130); a sweep stops here,
        # with the report of its points so far.
        if multirun:
            from sharded_exp.report.publish import write_report  # lazy: torch, not for Hydra's questions

            write_report(hc.sweep.dir)
        signum = result.signal or signal.SIGTERM
        done = result.steps_done
        where = f" after step {done}" if done is not None else f": {result.error}"
        log.error("stopped by signal %s%s", signum, where)
        sys.exit(128 + signum)
    if hc.mode == RunMode.MULTIRUN:
        # A failed point is data: it is recorded and the sweep goes on (Hydra's basic
        # sweeper would stop at the first exception and never call on_multirun_end, where
        # sharded_exp.report.command.ReportCallback writes the report).
        return result
    if result.status != "ok":
        log.error("error: %s (details in %s/result.json)", result.error, result.output_dir)
        sys.exit(1)
    return result


def start_job(cfg: DictConfig, output_dir: str, job_files: dict, identity: dict) -> "Result":
    """Begin the pre-flight check in the rank server, import what runs the ranks meanwhile,
    then launch (:func:`sharded_exp.launch.parent.launch`, which takes the check's answer)."""
    checking = check_early(cfg, output_dir)
    try:
        from sharded_exp.launch.parent import launch  # lazy: torch, imported while the server checks

        return launch(cfg, output_dir, job_files, started=(STARTED, IMPORTED), identity=identity, checking=checking)
    finally:
        if checking is not None:  # its answer read, or not wanted any more (a refusal, Ctrl-C)
            checking.cancel()


def check_early(cfg: DictConfig, output_dir: str):
    """This job's pre-flight check, begun in the rank server now, so that it runs while this
    process imports torch to run the ranks (:mod:`sharded_exp.launch.server_check`); None
    where the check runs in this process: under torchrun or srun, or when this process has
    imported what the check needs already (a library call, a test)."""
    if external_layout() is not None or not forkserver.started_early() or "torch._dynamo" in sys.modules:
        return None
    return server_check.start(cfg, output_dir)


def _record_config_error(*args, **kwargs) -> "Result":
    from sharded_exp.launch.parent import record_config_error  # lazy: torch, not for Hydra's questions

    return record_config_error(*args, **kwargs)


def what_ran(output_dir: str) -> str:
    """What an OSError out of the launch left: nothing ran, or the job ran and its result (or
    what followed it) could not be written; result.json says which, as the launcher left it."""
    from sharded_exp.job.result import read_json  # lazy: pydantic, not for the commands that run no job

    try:
        status = read_json(os.path.join(output_dir, "result.json")).get("status")
    except (OSError, ValueError, AttributeError):
        return "the job did not run"
    if status == "running":
        return f"the job ran, but its result could not be written ({output_dir}/result.json still says running)"
    return f"after the job ended (its result.json says {status})"


def os_error(cfg: DictConfig, exc: OSError) -> str:
    """``exc`` said with its path and the config key that holds the path, where one does:
    ``data.path=some_dir/: Is a directory``."""
    text = exc.strerror or str(exc)
    path = getattr(exc, "filename", None)
    if not path:
        return text
    try:
        leaves = _leaves(OmegaConf.to_container(cfg, resolve=True))
    except Exception:  # noqa: BLE001 -- a config that cannot resolve: the path alone
        leaves = []
    target = os.path.abspath(str(path))
    keys = [k for k, v in leaves if isinstance(v, str) and v and os.path.abspath(v) == target]
    return f"{keys[0]}={path}: {text}" if keys else f"{path}: {text}"


def _leaves(node, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], node


def read_result_in(output_dir: str) -> "Result | None":
    """The result.json a finished job left in ``output_dir``; None when it cannot be read."""
    from sharded_exp.job.result import read_result  # lazy: pydantic, not for the commands that run no job

    try:
        return read_result(os.path.join(output_dir, "result.json"))
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def run(started: float | None = None) -> None:
    """``python -m sharded_exp`` and the ``sharded-exp`` command (``started``: when the
    command's process started, if before this module was imported)."""
    global STARTED
    STARTED = started if started is not None else STARTED
    # Under torchrun / srun every rank runs this: one job, one run directory (layout.py).
    sys.argv[1:] = with_shared_run_dir(quote_numeric_choices(sys.argv[1:]))
    check_output_dirs(sys.argv[1:])
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the ranks' stop handling takes them over while they run
        signal.signal(sig, _stop_outside_the_job)
    try:
        main()
    except (KeyboardInterrupt, StopOutsideTheJob) as exc:
        # A stop outside the job's own handling (before its ranks start, or after it ended and
        # wrote its result.json): one line and the shell's exit code for the signal, no
        # traceback; a run directory made for nothing is not left behind.
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"error: stopped ({signal.Signals(signum).name}); what the job had written is kept", file=sys.stderr)
        logging.shutdown()  # its log closed first: nothing logs into the directory once it is gone
        if RUN_DIR is not None:
            remove_if_unused(RUN_DIR)
        exit_now(128 + signum)  # not the interpreter's teardown: torch's exit hooks would log again
    except SystemExit as exc:
        # Hydra reports what it cannot compose (an unknown key, option or group) and exits 1;
        # it is the user's mistake like any refused value: exit 2, as those do.
        if exc.code == 1 and not JOB_STARTED:
            sys.exit(2)
        raise
    if is_query(sys.argv[1:]):
        return
    from sharded_exp.report.command import ReportCallback  # lazy: torch, not for Hydra's questions

    # Non-zero when a sweep point failed for a reason other than running out of memory.
    exit_now(1 if ReportCallback.failed_points else 0)


if __name__ == "__main__":
    run()
