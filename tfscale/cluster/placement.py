"""Where this worker trains: the GPUs it sees, and its replicas and variables
checked against them before the first step.

TensorFlow 2.21's `MultiWorkerMirroredStrategy` decides how many GPUs a
worker's replicas go on from its cluster resolver: it counts them itself for
the `TFConfigClusterResolver` it builds when given none, and otherwise reads
`cluster_resolver.num_accelerators()`. A `SimpleClusterResolver` built
without `num_accelerators` answers `{}`, and the strategy then puts every
replica and variable of the worker on its CPU, GPUs or not (docs/facts.md,
fact 36): a compiled step fails at step 1 ("resource ... located in device
CPU:0 from device GPU:0"), an uncompiled one trains on the CPU, silently.

So one function answers which GPUs this worker sees, `devices.visible_gpus`:
TensorFlow's logical GPU devices, which already follow `CUDA_VISIBLE_DEVICES`
(what `launch.local --gpus_per_worker` / `--share_gpus`, `python -m
launch.gpus`, `tfscale-run --gpus_per_worker`, SLURM's `--gpus-per-task` and
Kubernetes' device plugin set) and `tf.config.set_visible_devices`. Every
strategy tfscale builds takes its devices from it (`strategies.py`,
`mpi.py`), MWMS's resolver through `num_accelerators`. `check` then proves,
before the first step, that the replicas and the trainable variables sit on
GPUs wherever the worker sees one (the Trainer, `enable_multi_worker_fit`
and every strategy `make_strategy` builds run it), and `Placement.describe`
is the start banner's line. To train on the CPU of a GPU host, hide its
GPUs (`CUDA_VISIBLE_DEVICES=`, `launch.local --gpus_per_worker 0`).
"""

import dataclasses
from typing import Optional, Sequence, Tuple

from tfscale.cluster import devices
from tfscale.errors import ConfigError


class PlacementError(ConfigError):
    """Replicas or variables are not on the GPUs the worker sees (one line,
    naming the worker, what it sees and where they are)."""

    def __init__(self, message: str):
        super().__init__(None, message)


def num_accelerators(gpus: Sequence[str]) -> dict:
    """A cluster resolver's `num_accelerators` for a worker that sees
    `gpus`: {"GPU": n}, or {} (its CPU) for none."""
    return {"GPU": len(gpus)} if gpus else {}


def short(device: str) -> str:
    """"/job:worker/replica:0/task:1/device:GPU:0" -> "GPU:0"."""
    return device.rsplit("device:", 1)[-1] if "device:" in device else device


def _on_gpu(device: str) -> bool:
    return "GPU" in short(device).upper()


def _names(devices: Sequence[str]) -> str:
    return ", ".join(short(d) for d in devices) or "none"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one worker trains.

    Attributes:
        worker: "worker 0", "rank 1": who.
        gpus: The GPUs it sees (`visible_gpus`).
        replicas: The devices its replicas sit on.
        variables: The devices its trainable variables sit on (each once),
            empty when none were checked (the strategy alone).
    """

    worker: str
    gpus: Tuple[str, ...]
    replicas: Tuple[str, ...]
    variables: Tuple[str, ...] = ()

    def describe(self) -> str:
        """The banner's line: "placement: 1 replica on GPU:0, variables on
        GPU:0 (worker 0 sees 1 GPU: GPU:0)"."""
        count = len(self.replicas)
        sees = (f"{self.worker} sees {len(self.gpus)} GPU"
                f"{'s' if len(self.gpus) != 1 else ''}: {_names(self.gpus)}"
                if self.gpus else f"{self.worker} sees no GPU")
        variables = (f", variables on {_names(self.variables)}"
                     if self.variables else "")
        return (f"placement: {count} replica{'s' if count != 1 else ''} on "
                f"{_names(self.replicas)}{variables} ({sees})")


def check(strategy, variables: Sequence = (), *, worker: str = "worker 0",
          gpus: Optional[Sequence[str]] = None) -> Placement:
    """Where `strategy` put this worker's replicas and `variables`, refused
    when the worker sees a GPU and they are not on one.

    Args:
        strategy: Any `tf.distribute` strategy (TensorFlow's default one
            too).
        variables: Keras or TensorFlow variables created under it (the
            model's, and once built the optimizer's slots); none: the
            replicas alone.
        worker: Who this is, for the line ("worker 1", "rank 0").
        gpus: What the worker sees (default: `devices.visible_gpus()`).

    Returns:
        The `Placement`.

    Raises:
        PlacementError: A GPU is visible and a replica, or a variable, is
            on another device.
    """
    gpus = tuple(devices.visible_gpus() if gpus is None else gpus)
    replicas = tuple(devices.worker_devices(strategy))
    on = {}
    for variable in variables:
        # A Keras variable's tensor is its `value`; a tf.Variable's is itself.
        value = getattr(variable, "value", variable)
        for part in strategy.experimental_local_results(
                variable if callable(value) else value):
            on.setdefault(part.device, getattr(variable, "path",
                                               variable.name))
    placement = Placement(worker=worker, gpus=gpus, replicas=replicas,
                          variables=tuple(on))
    if not gpus:
        return placement
    hide = ("; to train on the CPU, hide the GPUs (CUDA_VISIBLE_DEVICES= , "
            "launch.local --gpus_per_worker 0)")
    off = [d for d in replicas if not _on_gpu(d)]
    if off:
        raise PlacementError(
            f"{worker} sees {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} "
            f"({_names(gpus)}) but its strategy put its replicas on "
            f"{', '.join(replicas)} (a MultiWorkerMirroredStrategy whose "
            "cluster resolver has no num_accelerators counts 0 GPUs): "
            "build it with tfscale.make_strategy" + hide)
    stray = {d: name for d, name in on.items() if not _on_gpu(d)}
    if stray:
        device, name = next(iter(stray.items()))
        raise PlacementError(
            f"{worker} sees {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} "
            f"({_names(gpus)}) and its replicas are on {_names(replicas)}, "
            f"but variable {name} is on {device}: create the model and "
            "optimizer under strategy.scope(), outside any tf.device" + hide)
    return placement
