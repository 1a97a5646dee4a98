"""Who the workers are and how they sum values: one object per backend.

The Trainer, its step and `enable_multi_worker_fit` talk to the other
workers only through this interface:

    num_workers, worker_index, is_chief, num_replicas
    all_reduce(values)      inside a replica context: the sums over all
                            replicas of a list of tensors
    agree(value)            on the host: the sum over workers of one float
                            (flags, barriers); every worker must call it
    broadcast_from_chief(variables)
                            the chief's values everywhere (a fresh start)
    reduces_metrics         whether metric states are local to each
                            process and must be summed by the step

Two implementations:
  - `StrategyCollectives` (backend "mwms", the default): the strategy's own
    collectives: MultiWorkerMirroredStrategy's ring over gRPC on CPUs, NCCL
    on GPUs. Variables are synchronized when created; metric variables
    aggregate on read.
  - `tfscale.mpi.MpiCollectives` (backend "mpi"): one single-replica
    strategy per process, gradients summed with `MPI.Allreduce`.
"""

from typing import Optional

import tensorflow as tf

from tfscale import _compat
from tfscale.cluster import chief_and_worker_count, worker_index

BACKENDS = ("mwms", "mpi")


class StrategyCollectives:
    """The collectives of a `tf.distribute` strategy."""

    name = "mwms"
    reduces_metrics = False

    def __init__(self, strategy):
        self.strategy = strategy
        self.is_chief, self.num_workers = chief_and_worker_count(strategy)
        self.worker_index = worker_index(strategy)
        self.num_replicas = strategy.num_replicas_in_sync
        self._options = _compat.communication_options(strategy)
        self._sum = tf.function(self._sum_fn)

    def all_reduce(self, values):
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, list(values), options=self._options)

    def agree(self, value: float) -> float:
        if self.num_workers == 1:
            return float(value)
        total = self._sum(tf.constant(float(value)))
        return float(self.strategy.experimental_local_results(total)[0])

    def _sum_fn(self, value):
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.identity(value))
        return self.strategy.run(replica_fn)

    def broadcast_from_chief(self, variables) -> None:
        """Nothing to do: the strategy synchronized them when created."""

    def barrier(self) -> None:
        """Returns when every worker has called it."""
        self.agree(0.0)


def make(backend: str, strategy, timeout_seconds: Optional[float] = 300.0,
         bucket_bytes: int = 0):
    """The collectives of `backend` ("mwms" or "mpi") under `strategy`.

    `timeout_seconds` and `bucket_bytes` apply to "mpi" (see
    `tfscale.mpi.MpiCollectives`; a strategy's collectives take theirs from
    its `CommunicationOptions`).

    Raises:
        ValueError: Unknown backend, or a strategy that does not fit it.
        ImportError: "mpi" without mpi4py.
    """
    if backend == "mwms":
        return StrategyCollectives(strategy)
    if backend == "mpi":
        from tfscale import mpi
        return mpi.MpiCollectives(strategy, timeout_seconds=timeout_seconds,
                                  bucket_bytes=bucket_bytes)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
