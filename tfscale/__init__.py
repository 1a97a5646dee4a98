"""tfscale: distributed training for TensorFlow 2 / Keras 3 models.

The names below are imported on first use, so `import tfscale.cli` (what
an entry point does before TensorFlow loads) loads nothing else.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ClusterConfig": "tfscale.cluster",
    "ClusterInfo": "tfscale.cluster",
    "resolve_cluster": "tfscale.cluster",
    "make_strategy": "tfscale.strategies",
    "OptimConfig": "tfscale.optim",
    "enable_multi_worker_fit": "tfscale.keras_fit",
    "TrainConfig": "tfscale.train_config",
    "Trainer": "tfscale.trainer",
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
