"""The error a configuration raises, with the field at fault, and the one
map from config fields to the flags that set them.

Keras names the argument where it raises; tfscale's configs do the same:
`ConfigError(field, message)` carries the config field (`global_batch_size`,
`noise_scale`, `scaling_rule`), and `FLAG_OF_FIELD` turns a field into its
flag (the jobs' entry points and `tfscale/jobs.py` use it), so no caller
reads the message to guess the field.
"""

import os
import re
import sys
from typing import Optional

# The exit code of an uncaught ConfigError: `tfscale.cluster.contract`'s
# CONFIG_ERROR_EXIT_CODE, which launchers do not restart (this module sits
# below the cluster package; tests/test_cli.py checks the two agree).
CONFIG_ERROR_EXIT_CODE = 2

# Config fields whose flag has another name (every job names them alike).
FLAG_OF_FIELD = {"global_batch_size": "train_batch_size",
                 "total_steps": "num_train_steps",
                 "warmup_steps": "num_warmup_steps",
                 "schedule": "lr_schedule", "scaling_rule": "lr_scaling",
                 "log_steps": "iterations_per_loop", "jit_compile": "xla",
                 "collective_timeout_seconds": "collective_timeout",
                 "connect_timeout_seconds": "connect_timeout",
                 "heartbeat_timeout_seconds": "heartbeat_timeout",
                 "order": "input_order", "output_dtype": "image_dtype"}


def flag_message(message: str, flags_defined, renamed=None) -> str:
    """A config's message in flag names: "global_batch_size must be > 0" ->
    "--train_batch_size must be > 0" (fields renamed by FLAG_OF_FIELD, then
    `renamed`, a job's own; a leading field that is a flag gets its --)."""
    names = dict(FLAG_OF_FIELD, **(renamed or {}))
    for field, flag in names.items():
        if flag in flags_defined:
            message = re.sub(rf"(?<![-\w]){field}\b", f"--{flag}", message)
    first = message.split(" ", 1)[0]
    if first in flags_defined:
        message = "--" + message
    return message


class ConfigError(ValueError):
    """A setting that cannot work.

    Left uncaught, it ends the process with `CONFIG_ERROR_EXIT_CODE` (2),
    the code launchers do not restart (another attempt would fail alike),
    not Python's 1: its first construction installs `exits_2_uncaught`.

    Attributes:
        field: The config field at fault (None: no one field).
    """

    def __init__(self, field: Optional[str], message: str):
        self.field = field
        super().__init__(message)
        exits_2_uncaught()


def chain_excepthook(mark: str, make_hook) -> None:
    """Installs `make_hook(previous hook)` as `sys.excepthook`, once per
    `mark`; not in an interactive session (a REPL calls the hook for every
    error typed at the prompt)."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return
    if getattr(sys.excepthook, mark, False):
        return
    hook = make_hook(sys.excepthook)
    setattr(hook, mark, True)
    sys.excepthook = hook


def exits_2_uncaught() -> None:
    """Makes an uncaught `ConfigError` end the process with exit code 2
    after Python's traceback and a line; other errors are left to the hook
    before (installed once)."""
    def make_hook(previous):
        def hook(kind, value, traceback):
            if not issubclass(kind, ConfigError):
                return previous(kind, value, traceback)
            previous(kind, value, traceback)
            sys.stderr.write(f"tfscale: error: {value} (a setting: exit "
                             f"{CONFIG_ERROR_EXIT_CODE}, not restarted)\n")
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(CONFIG_ERROR_EXIT_CODE)
        return hook
    chain_excepthook("_tfscale_setting_errors", make_hook)


class MissingExtra(ImportError):
    """An optional module is not installed; the message names the module,
    its extra and the pip command, in one line (the entry points print it
    so, with no traceback)."""


class DiskFull(ConfigError):
    """No room left where a file or checkpoint is written (ENOSPC, a
    quota): another attempt would fail alike until space is freed, so it
    exits `CONFIG_ERROR_EXIT_CODE` (launchers do not restart it). The
    message names the folder, what the write needed and what is free."""

    def __init__(self, message: str):
        super().__init__(None, message)


class CollectiveMisuse(ConfigError):
    """A collective called on some workers only (`evaluate()` on the chief
    alone): the program's error, which a restart would repeat, in one line
    naming the workers that did not come."""

    def __init__(self, message: str):
        super().__init__(None, message)

    @classmethod
    def of(cls, what: str, worker: int, missing: dict,
           seconds: float) -> "CollectiveMisuse":
        """The error of a rendezvous for `what` on `worker` that found
        `missing` ({worker index: what it reached instead, or None: did not
        come within `seconds`})."""
        said = []
        for index, instead in sorted(missing.items()):
            said.append(f"worker {index} " + (
                f"reached {instead} instead" if instead else
                f"did not call it within {seconds:g} s (or left)"))
        return cls(f"{what} is a collective, as fit is: call it on every "
                   f"worker (on worker {worker}: {'; '.join(said)})")
