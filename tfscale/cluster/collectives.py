"""Who the workers are and how they sum values: one object per backend.

The Trainer, its step and `enable_multi_worker_fit` talk to the other
workers only through this interface:

    num_workers, worker_index, is_chief, num_replicas
    all_reduce(values)      inside a replica context: the sums over all
                            replicas of a list of tensors
    reduce_scatter(flat)    inside a replica context: flat [R x S] summed
                            over the R replicas, row r to replica r ([S])
    all_gather(shard)       inside a replica context: [S] of every replica
                            end to end, [R x S] (both for
                            `zero/optimizer.py`'s sharded optimizer state)
    agree(value)            on the host: the sum over workers of one float
                            (flags); every worker must call it
    gather(name, mine, seconds)
                            on the host: every worker's string on the
                            chief (each log interval's numbers), its own
                            elsewhere; no collective on "mwms"
    rendezvous(what, seconds)
                            on the host: returns once every worker has
                            called it for the same `what`; refuses in one
                            line (`errors.CollectiveMisuse`) when one has not
                            within `seconds` (e.g. `evaluate()` called on
                            the chief alone)
    barrier()               on the host: returns when every worker called it
    leave_together()        the last call before the process exits: returns
                            when no worker needs this one any more
    broadcast_from_chief(variables)
                            the chief's values everywhere (a fresh start)
    abort                   None, or `fn(code)` that ends every worker of
                            the job at once (MPI_Abort); None: a worker
                            that leaves ends its peers' collectives
    reduces_metrics         whether metric states are local to each
                            process and must be summed by the step

Two implementations:
  - `StrategyCollectives` (backend "mwms", the default): the strategy's own
    collectives: MultiWorkerMirroredStrategy's ring over gRPC on CPUs, NCCL
    on GPUs. Variables are synchronized when created; metric variables
    aggregate on read.
  - `tfscale.cluster.mpi.MpiCollectives` (backend "mpi"): one single-replica
    strategy per process, gradients summed with `MPI.Allreduce`.
"""

import atexit
from typing import Optional

import tensorflow as tf
from absl import logging

from tfscale import _compat
from tfscale.cluster.strategies import chief_and_worker_count, worker_index
from tfscale.errors import CollectiveMisuse

BACKENDS = ("mwms", "mpi")

# A barrier with no collective timeout configured waits this long.
_NO_TIMEOUT_SECONDS = 24 * 3600
# How long the chief waits for the others to leave the last barrier.
_LEAVE_TIMEOUT_MS = 60_000


class StrategyCollectives:
    """The collectives of a `tf.distribute` strategy."""

    name = "mwms"
    reduces_metrics = False
    # A worker that exits closes its gRPC channels: its peers' collectives
    # and the coordination service's heartbeats fail, the launcher sees it.
    abort = None

    def __init__(self, strategy):
        self.strategy = strategy
        self.is_chief, self.num_workers = chief_and_worker_count(strategy)
        self.worker_index = worker_index(strategy)
        self.num_replicas = strategy.num_replicas_in_sync
        self._options = _compat.communication_options(strategy)
        self._sum = tf.function(self._sum_fn, autograph=False)
        timeout = getattr(self._options, "timeout_seconds", None)
        self._timeout_ms = int(1000 * (timeout or _NO_TIMEOUT_SECONDS))
        self._barriers = 0
        self._rendezvous = 0
        self._exchanges = 0
        self._gathers = 0
        if self.num_workers > 1:
            # A script that ends while a peer waits in a rendezvous (the
            # chief's lone `evaluate()`) says so at once.
            atexit.register(self._announce_end)

    def all_reduce(self, values):
        return tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, list(values), options=self._options)

    def reduce_scatter(self, flat):
        # TensorFlow 2.21's reduce-scatter op has only an NCCL kernel: each
        # replica sends row j to replica j (an all-to-all moves what a
        # ring reduce-scatter moves) and sums what it receives, in replica
        # order (at 2 replicas, the all-reduce's a + b).
        rows = tf.reshape(flat, [self.num_replicas, -1])
        received = _compat.all_to_all(self.strategy, rows, self._options)
        return sum_rows(received, self.num_replicas)

    def all_gather(self, shard):
        return tf.distribute.get_replica_context().all_gather(
            shard, axis=0, options=self._options)

    def agree(self, value: float) -> float:
        if self.num_workers == 1:
            return float(value)
        total = self._sum(tf.constant(float(value)))
        return float(self.strategy.experimental_local_results(total)[0])

    def agree_flags(self, *flags) -> list:
        """How many replicas raised each of `flags` (one all-reduce for
        all of them)."""
        if self.num_workers == 1:
            return [float(bool(f)) for f in flags]
        total = self._sum(tf.constant([float(bool(f)) for f in flags]))
        return [float(v) for v in
                self.strategy.experimental_local_results(total)[0].numpy()]

    def _sum_fn(self, value):
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.identity(value))
        return self.strategy.run(replica_fn)

    def rendezvous(self, what: str, seconds: float) -> None:
        """Every worker has called `rendezvous(what, ...)` as its n-th
        rendezvous, or `CollectiveMisuse` (through the coordination
        service's key-value store: no collective that a worker doing
        something else would meet)."""
        if self.num_workers == 1:
            return
        service = _compat.coordination_service()
        if service is None:
            return
        self._rendezvous += 1
        key = f"tfscale/rendezvous/{self._rendezvous}"
        service.set_config_key_value(f"{key}/{self.worker_index}", what)
        missing = {}
        for index in range(self.num_workers):
            if index == self.worker_index:
                continue
            try:
                theirs = service.get_config_key_value(f"{key}/{index}",
                                                      int(seconds * 1000))
            except tf.errors.OpError:
                missing[index] = None
                continue
            if theirs != what:
                missing[index] = theirs
        if missing:
            raise CollectiveMisuse.of(what, self.worker_index, missing,
                                      seconds)

    def exchange(self, name: str, mine: str, seconds: float) -> dict:
        """{worker index: its value} once every worker has called
        `exchange(name, ...)`, through the coordination service's
        key-value store (no collective); a worker that does not come
        within `seconds` is left out. Only this worker's value without the
        service."""
        self._exchanges += 1
        return self._through_store(
            f"tfscale/exchange/{self._exchanges}/{name}", mine, seconds,
            everyone=True)

    def gather(self, name: str, mine: str, seconds: float) -> dict:
        """On the chief: {worker index: its value} once every worker has
        called `gather(name, ...)` (a worker that does not come within
        `seconds` is left out); elsewhere {own index: `mine`}, at once. No
        collective: the coordination service's key-value store, each key
        deleted once read."""
        self._gathers += 1
        return self._through_store(
            f"tfscale/gather/{self._gathers}/{name}", mine, seconds,
            everyone=False)

    def _through_store(self, key: str, mine: str, seconds: float, *,
                       everyone: bool) -> dict:
        """`mine` under `key`/<this worker>, and the others' values read
        by every worker (`everyone`) or by the chief alone, which deletes
        them once read."""
        values = {self.worker_index: mine}
        service = _compat.coordination_service()
        if self.num_workers == 1 or service is None:
            return values
        reads = everyone or self.is_chief
        if everyone or not self.is_chief:
            service.set_config_key_value(f"{key}/{self.worker_index}", mine)
        for index in range(self.num_workers if reads else 0):
            if index == self.worker_index:
                continue
            try:
                values[index] = service.get_config_key_value(
                    f"{key}/{index}", int(seconds * 1000))
                if not everyone:
                    service.delete_config_key_value(f"{key}/{index}")
            except tf.errors.OpError:
                continue
        return values

    def _announce_end(self) -> None:
        """At a normal exit: the next rendezvous slot says the program
        ended (peers waiting there learn it at once)."""
        service = _compat.coordination_service()
        if service is None:
            return
        try:
            service.set_config_key_value(
                f"tfscale/rendezvous/{self._rendezvous + 1}/"
                f"{self.worker_index}", "the end of its program")
        except tf.errors.OpError:
            pass

    def broadcast_from_chief(self, variables) -> None:
        """Nothing to do: the strategy synchronized them when created."""

    def barrier(self) -> None:
        """Returns when every worker has called it.

        A barrier of the coordination service (on task 0), not an
        all-reduce: a worker that has finished a collective may still be
        serving its part of it to a slower peer (the ring's RecvBuf), so a
        collective cannot tell a worker that the others are done with it.
        Once every worker has reached this barrier, every earlier collective
        is complete everywhere.
        """
        if self.num_workers == 1:
            return
        service = _compat.coordination_service()
        if service is None:  # (MWMS without a cluster has one worker)
            self.agree(0.0)
            return
        self._barriers += 1
        service.wait_at_barrier(f"tfscale/barrier/{self._barriers}",
                                self._timeout_ms)

    def leave_together(self) -> None:
        """The last call before this process exits: returns once no other
        worker needs it.

        Every worker passes a barrier (so every collective is complete), and
        the chief, which hosts the coordination service, then waits until
        each other worker has reported that it left the barrier: had it
        exited at once, a peer still waiting for the barrier's answer would
        lose its connection and fail. (With an all-reduce as the last
        barrier, one of three workers once failed so, "RingReduce ...
        Socket closed" in a RecvBuf from the chief that had just exited.)
        The work is done by then: a chief that waits in vain logs it and
        leaves, and a worker whose report finds the chief gone (it can
        leave between storing the last report and answering it) leaves
        too.
        """
        if self.num_workers == 1:
            return
        # A worker still inside a collective of its own (`evaluate()` on
        # the chief alone) learns at once that this one is leaving.
        self.rendezvous("leave_together()", self._timeout_ms / 1000)
        self.barrier()
        service = _compat.coordination_service()
        if service is None:
            return
        if not self.is_chief:
            try:
                service.set_config_key_value(
                    f"tfscale/left/{self.worker_index}", "1")
            except tf.errors.UnavailableError:
                # The chief stored the report and left before its answer
                # arrived (or gave up waiting): either way, nobody needs
                # this worker any more.
                pass
            return
        for index in range(1, self.num_workers):
            try:
                service.get_config_key_value(f"tfscale/left/{index}",
                                             _LEAVE_TIMEOUT_MS)
            except tf.errors.OpError as e:
                logging.warning("tfscale: worker %d did not report leaving "
                                "the last barrier (%s); exiting anyway",
                                index, str(e).splitlines()[0])
                return


def sum_rows(rows, count: int):
    """rows[0] + rows[1] + ... in that order (a reduction op may add
    another way)."""
    total = rows[0]
    for i in range(1, count):
        total = total + rows[i]
    return total


def make(backend: str, strategy, timeout_seconds: Optional[float] = 300.0,
         bucket_bytes: int = 0):
    """The collectives of `backend` ("mwms" or "mpi") under `strategy`.

    `timeout_seconds` and `bucket_bytes` apply to "mpi" (see
    `tfscale.cluster.mpi.MpiCollectives`; a strategy's collectives take theirs from
    its `CommunicationOptions`).

    Raises:
        ValueError: Unknown backend, or a strategy that does not fit it.
        ImportError: "mpi" without mpi4py.
    """
    if backend == "mwms":
        return StrategyCollectives(strategy)
    if backend == "mpi":
        from tfscale.cluster import mpi
        return mpi.MpiCollectives(strategy, timeout_seconds=timeout_seconds,
                                  bucket_bytes=bucket_bytes)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
