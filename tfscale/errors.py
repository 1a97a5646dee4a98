"""The error a configuration raises, with the field at fault, and the one
map from config fields to the flags that set them.

Keras names the argument where it raises; tfscale's configs do the same:
`ConfigError(field, message)` carries the config field (`global_batch_size`,
`noise_scale`, `scaling_rule`), and `FLAG_OF_FIELD` turns a field into its
flag (the jobs' entry points and `tfscale/jobs.py` use it), so no caller
reads the message to guess the field.
"""

import re

# Config fields whose flag has another name (every job names them alike).
FLAG_OF_FIELD = {"global_batch_size": "train_batch_size",
                 "total_steps": "num_train_steps",
                 "warmup_steps": "num_warmup_steps",
                 "schedule": "lr_schedule", "scaling_rule": "lr_scaling",
                 "log_steps": "iterations_per_loop", "jit_compile": "xla",
                 "collective_timeout_seconds": "collective_timeout",
                 "connect_timeout_seconds": "connect_timeout",
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

    Attributes:
        field: The config field at fault.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


class MissingExtra(ImportError):
    """An optional module is not installed; the message names the module,
    its extra and the pip command, in one line (the entry points print it
    so, with no traceback)."""
