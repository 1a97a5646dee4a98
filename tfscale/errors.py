"""The error a configuration raises, with the field at fault.

Keras names the argument where it raises; tfscale's configs do the same:
`ConfigError(field, message)` carries the config field (`global_batch_size`,
`noise_scale`, `scaling_rule`), and the edge maps a field to its flag in one
place (`tfscale/jobs.py`), so no caller reads the message to guess it.
"""


class ConfigError(ValueError):
    """A setting that cannot work.

    Attributes:
        field: The config field at fault.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)
