"""What every entry point does at its edge, before TensorFlow loads.

TensorFlow-free (importing `tfscale` loads nothing else: its names are
imported on first use), so an entry point can quiet TensorFlow's start-up
before anything imports it.
"""

import glob
import importlib
import logging
import os
import re
import resource
import signal
import sys
import tempfile
import traceback
from typing import Callable

from absl import app, flags

# Lines TensorFlow prints while it loads and looks for GPUs. On a host with
# no NVIDIA device they say nothing ("failed call to cuInit: ... CUDA error"
# reads as a failure), so a quiet run drops them there.
from tfscale.cluster.contract import CONFIG_ERROR_EXIT_CODE, CPU_HOST_NOISE


class _NoTensorFlowInfo(logging.Filter):
    """Drops INFO (and DEBUG) records logged from TensorFlow's own files."""

    def filter(self, record):
        return (record.levelno >= logging.WARNING or
                f"{os.sep}tensorflow{os.sep}" not in record.pathname)


def quiet_tensorflow(verbosity: int):
    """TensorFlow's INFO lines off (one per collective, per checkpoint shard,
    per server start); its warnings and errors, and tfscale's own lines,
    stay. `--verbosity=1` or a TF_CPP_MIN_LOG_LEVEL of one's own brings them
    back. (The few lines TensorFlow prints while loading, before its logging
    is set up, cannot be turned off from Python.)"""
    if verbosity >= 1:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # before TF's import
    for name in ("tensorflow", "absl"):
        logging.getLogger(name).addFilter(_NoTensorFlowInfo())
    if not _has_nvidia_device():
        _load_tensorflow_without_gpu_noise()


def _has_nvidia_device() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"))


def _load_tensorflow_without_gpu_noise() -> None:
    """Imports TensorFlow and lets it probe for GPUs with file descriptor 2
    captured, then passes on every captured line but the CPU-host noise.
    (TensorFlow's C++ logging writes there directly, before Python's logging
    or TF_CPP_MIN_LOG_LEVEL apply.)"""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf
            tf.config.list_physical_devices()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(True)
            kept = [line for line in lines
                    if not any(noise in line for noise in CPU_HOST_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def usage_error(program: str, message: str):
    """One line on stderr naming the program, and exit
    `CONFIG_ERROR_EXIT_CODE` (2): a setting the program cannot run with,
    which launchers do not restart."""
    sys.stderr.write(f"{program}: error: {message}\n")
    sys.stderr.flush()
    sys.exit(CONFIG_ERROR_EXIT_CODE)


def run_job(program: str, job: Callable, config) -> None:
    """Runs `job(config)` on this worker, then leaves the process (`leave`):
    exit 0; a `JobError` (or a `ConfigError` raised while training, a full
    disk) becomes one line on stderr and exit 2
    (`CONFIG_ERROR_EXIT_CODE`: launchers do not restart), or 1 when another
    attempt may succeed (`JobError.restartable`); preemption prints a line
    and exits 143 after the checkpoint (launchers and schedulers restart
    the job), Ctrl-C 130; any other error, its traceback and exit 1.
    """
    from tfscale.errors import ConfigError, MissingExtra
    from tfscale.jobs import JobError
    from tfscale.resume.preemption import Preempted
    raise_open_file_limit()
    try:
        job(config)
    except MissingExtra as e:
        print(f"{program}: error: {e}", file=sys.stderr)
        leave(CONFIG_ERROR_EXIT_CODE)
    except JobError as e:
        print(f"{program}: error: "
              f"{e.line(getattr(config, 'flag_names', None))}",
              file=sys.stderr)
        leave(1 if e.restartable else CONFIG_ERROR_EXIT_CODE)
    except ConfigError as e:  # raised while running: a full disk
        print(f"{program}: error: {e}", file=sys.stderr)
        leave(CONFIG_ERROR_EXIT_CODE)
    except Preempted as e:
        print(f"{program}: {e}", file=sys.stderr)
        leave(e.code)
    except KeyboardInterrupt:
        # Ctrl-C: the Trainer saved the agreed step first (preemption.py).
        print(f"{program}: interrupted (Ctrl-C)", file=sys.stderr)
        leave(128 + signal.SIGINT)
    except Exception as e:  # noqa: BLE001 - reported, then the same fast exit
        from tfscale.cluster.fail_fast import error_line
        traceback.print_exc()
        print(f"{program}: error: {error_line(type(e), e)}", file=sys.stderr)
        leave(1)
    leave(0)


def entry_point(program: str, make_config: Callable, job: str,
                required=()) -> Callable:
    """A job's console script: `run()` parses the flags (absl), answers a
    missing `required` flag and stray arguments in one line before
    TensorFlow loads, quiets TensorFlow (before anything imports it),
    builds the config (`make_config()` exits with one line on a bad value),
    imports `job` ("module:function", which loads TensorFlow) and runs it
    as `run_job` does.

        run = cli.entry_point("run_pretraining", config_from_flags,
                               "models.tasks.pretraining:train_and_evaluate",
                               required=(("input_file", "input_files_dir"),
                                         "output_dir"))
    """
    def main(argv):
        from absl import logging as absl_logging
        if len(argv) > 1:
            usage_error(program, f"unexpected arguments {argv[1:]}")
        quiet_tensorflow(absl_logging.get_verbosity())  # --verbosity
        config = make_config()
        module, function = job.split(":")
        run_job(program, getattr(importlib.import_module(module), function),
                config)

    return lambda: run_main(program, main, required)


def run_main(program: str, main: Callable, required=()) -> None:
    """Every entry point's console script: `--help` lists the project's
    flags, absl parses the command line, and a flag of `required` left
    empty ends the program with `PROGRAM: error: --FLAG is required` before
    `main(argv)` runs (and before TensorFlow loads: under a second).

    Args:
        required: Flag names; a tuple of names where any one will do; a
            name "noNAME" is given when the boolean flag NAME is false
            (("train_files", "nodo_train"): training needs files).
    """
    def checked(argv):
        from tfscale.errors import MissingExtra
        missing = missing_flag(required)
        if missing:
            usage_error(program, f"{missing} is required")
        try:
            return main(argv)
        except MissingExtra as e:
            usage_error(program, str(e))

    list_flags_in_help()
    app.run(checked, flags_parser=_parse_flags)


def _parse_flags(argv):
    """absl's parsing, a bad flag answered as absl answers it but with
    `CONFIG_ERROR_EXIT_CODE` (absl exits 1, which reads as a crash)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.stderr.write(f"FATAL Flags parsing error: {e}\n"
                         "Pass --helpshort or --helpfull to see help on "
                         "flags.\n")
        sys.exit(CONFIG_ERROR_EXIT_CODE)


def missing_flag(required) -> str:
    """The first item of `required` (see `run_main`) the command line left
    empty, as the flags to give ("--a or --b"); "" when none is."""
    values = flags.FLAGS
    for item in required:
        names = (item,) if isinstance(item, str) else tuple(item)
        if not any(_given(values, name) for name in names):
            return " or ".join(f"--{name}" for name in names)
    return ""


def _given(values, name: str) -> bool:
    if name not in values and name.startswith("no"):
        return values[name[2:]].boolean and not values[name[2:]].value
    return bool(values[name].value)


_PACKAGES = ("models", "tfscale", "input_pipelines", "launch")


def list_flags_in_help() -> None:
    """Makes `--help` (and `--helpshort`) list the project's flags, grouped
    as `--helpfull` groups them (by module, or by named group "name (N)
    concern"), without the flags of absl and of libraries that define
    some on import. absl's own `--help` lists the main module's key flags
    only, and an entry point's flags live in modules it imports."""
    app.define_help_flags()  # idempotent; app.run calls it again
    values = flags.FLAGS
    for flag in (values["help"], values["helpshort"]):
        for name in {flag.name, flag.short_name} - {None}:
            delattr(values, name)
    for flag in (_ProjectHelp(), _ProjectHelpShort()):
        flags.DEFINE_flag(flag, module_name=app.__name__)


def project_flags_help() -> str:
    """The project's flags, one section per module or named group."""
    values = flags.FLAGS
    # The project's modules and its named --helpfull groups ("name (N)
    # concern"); not absl's, nor those libraries define on import.
    # The main module's first (a script's flags are defined in it).
    groups = sorted(
        (module for module in values.flags_by_module_dict()
         if module == sys.argv[0] or module.split(".")[0] in _PACKAGES
         or re.match(r"\w+ \(\d+\) ", module)),
        key=lambda module: (module != sys.argv[0], module))
    return "\n".join(values.module_help(module) for module in groups)


class _ProjectHelp(app.HelpFlag):
    """--help: the program's docstring and `project_flags_help()`, then
    exit code 0 (absl's exits 1: asking for help is no error)."""

    def parse(self, arg):
        if self._parse(arg):
            doc = (sys.modules["__main__"].__doc__
                   or f"\nUSAGE: {sys.argv[0]} [flags]\n")
            sys.stdout.write(f"{doc}\nflags:\n{project_flags_help()}\n\n"
                             "Try --helpfull to get a list of all flags.\n")
            sys.stdout.flush()
            sys.exit(0)


class _ProjectHelpShort(_ProjectHelp):
    NAME = "helpshort"
    SHORT_NAME = None


def raise_open_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit and
    returns the new soft limit.

    Many cluster nodes start jobs with a soft limit of 1,024 descriptors
    and a far higher hard one; ImageNet has 1,152 record files and
    Wikipedia-scale BERT sets thousands. (The record reader also bounds the
    descriptors it holds, for hard limits that low.)
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY \
            and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft


def leave(code: int) -> None:
    """Exits once everything written is flushed and closed, without
    tearing TensorFlow down (`tfscale.cluster.fail_fast.leave`).

    Python's normal exit joins every non-daemon thread and runs TensorFlow's
    destructors; in TF 2.21 a finished tf.data iterator's deletion can block
    there for up to a minute (its autotune thread; `python -m
    benchmarks.pipelines.iterator_deletion`), past Kubernetes' 30 s grace after
    SIGTERM. By the time a job returns or unwinds, its checkpoints,
    summaries and result files are written and closed (the Trainer's saves
    are synchronous and `Trainer.fit` closes the callbacks' writers on every
    way out; result files are written in `with` blocks). Under MPI a failed
    rank aborts the job instead of finalizing, so its peers do not wait for
    it in their next collective.
    """
    from tfscale.cluster import fail_fast
    fail_fast.leave(code)
