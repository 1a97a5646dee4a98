"""tfscale: distributed training for TensorFlow 2 / Keras 3 models.

The engine's packages, bottom to top (docs/architecture.md): the base
modules (`errors`, `_compat`, `lazy`, `durable`, `precision`, `xla_flags`),
`optim`, `cluster`, `noise`, `train_config`, `step`, `keras`, `resume`,
`zero`, `trainer`, then `jobs` (the job skeleton) with `job_lines` (what a
job prints) and the entry points' `cli`; `horovod` beside them on the
cluster layer.

    errors.py        ConfigError (the field at fault), MissingExtra, the
                     field-to-flag map
    _compat.py       every TensorFlow and Keras version workaround
    lazy.py          names a package exports, imported on first use
    durable.py       files written whole (fsync, rename)
    precision.py     the dtype policy and fp16's loss scale
    xla_flags.py     XLA on or off, and the XLA_FLAGS a GPU run gets
    train_config.py  TrainConfig: how the Trainer trains
    jobs.py          the job skeleton (flags -> ... -> results -> leave)
    job_lines.py     the lines a job prints before and after training
    cli.py           what every entry point does before TensorFlow loads

The names below are imported on first use, so `import tfscale.cli` (what
an entry point does before TensorFlow loads) loads nothing else.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

_EXPORTS = {
    "ClusterConfig": "tfscale.cluster.environment",
    "ClusterInfo": "tfscale.cluster.environment",
    "resolve_cluster": "tfscale.cluster.environment",
    "make_strategy": "tfscale.cluster.strategies",
    "OptimConfig": "tfscale.optim",
    "enable_multi_worker_fit": "tfscale.keras.multi_worker_fit",
    "TrainConfig": "tfscale.train_config",
    "Trainer": "tfscale.trainer.loop",
}
# Subpackages and modules reachable as attributes (`tfscale.jobs.run`).
_MODULES = ("jobs", "optim", "horovod")
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(f"tfscale.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfscale' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return sorted(list(globals()) + __all__)


# The modules' names before the engine was split into packages (version
# 0.1.0 of 2026-11-26): `import tfscale.strategies` and `from tfscale
# import strategies` still work, with a DeprecationWarning naming the new
# module.
MOVED = {
    "tfscale._compat_callbacks": "tfscale.keras.callbacks",
    "tfscale._watchdog": "tfscale.cluster.watchdog",
    "tfscale.callback_files": "tfscale.keras.callback_files",
    "tfscale.checkpointing": "tfscale.resume.checkpoints",
    "tfscale.collectives": "tfscale.cluster.collectives",
    "tfscale.console": "tfscale.trainer.console",
    "tfscale.dllogger": "models.tasks.dllogger",
    "tfscale.evaluation": "tfscale.trainer.evaluation",
    "tfscale.fail_fast": "tfscale.cluster.fail_fast",
    "tfscale.fit_arguments": "tfscale.keras.fit_arguments",
    "tfscale.keras_fit": "tfscale.keras.multi_worker_fit",
    "tfscale.loss_metrics": "tfscale.step.losses",
    "tfscale.memory": "tfscale.trainer.memory",
    "tfscale.mpi": "tfscale.cluster.mpi",
    "tfscale.noise_advice": "tfscale.noise.advice",
    "tfscale.noise_norms": "tfscale.noise.norms",
    "tfscale.noise_scale": "tfscale.noise.scale",
    "tfscale.preemption": "tfscale.resume.preemption",
    "tfscale.replica_feed": "tfscale.step.feed",
    "tfscale.replica_step": "tfscale.step.replica",
    "tfscale.reporting": "tfscale.trainer.reporting",
    "tfscale.run_position": "tfscale.resume.position",
    "tfscale.sharded_sync": "tfscale.step.sharded_sync",
    "tfscale.step_plan": "tfscale.step.plan",
    "tfscale.step_row": "tfscale.step.row",
    "tfscale.strategies": "tfscale.cluster.strategies",
    "tfscale.timing": "tfscale.trainer.timing",
    "tfscale.trainer_parts": "tfscale.trainer.parts",
    "tfscale.zero_checkpoint": "tfscale.zero.checkpoint",
    "tfscale.zero_layout": "tfscale.zero.layout",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module's old name (`MOVED`) as its new module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} is now {new}", DeprecationWarning,
                      stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
