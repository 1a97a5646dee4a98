"""The MPI backend: data parallelism with `MPI.Allreduce` (mpi4py).

TensorFlow's multi-worker all-reduce on CPUs goes through gRPC RPCs, several
copies per step (docs/mpi.md and benchmarks/README.md have the
measurements). Here
each process runs a single-replica strategy and the step's one all-reduce of
[loss and flags, *gradients, *metric deltas] is `MPI.Allreduce` of one fused
buffer per dtype (or of buckets, issued in reverse layer order, when
`bucket_bytes` is set), called from the graph through `tf.numpy_function`.
Rank 0 is the chief; the initial weights are broadcast from it; each rank
reads its own shard of the input.

Metric variables are local to each process, so the step sums their changes
(`reduces_metrics`): every process then holds the global states, as the
metric variables of a MultiWorkerMirroredStrategy do.

Requires mpi4py and an MPI library: `pip install '.[mpi]'` in tfscale's
checkout (mpi4py and Open MPI from PyPI), or mpi4py built against the
site's MPI.
"""

import contextlib
import sys
import threading
import time
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from tfscale.cluster import devices
from tfscale.cluster import environment as cluster
from tfscale.errors import CollectiveMisuse

_INSTALL_HINT = ("the MPI backend needs mpi4py and an MPI library: "
                 "pip install '.[mpi]' in tfscale's checkout (or mpi4py "
                 "built against your site's MPI)")


def import_mpi():
    """`mpi4py.MPI` (initializing MPI), or ImportError with the fix."""
    cluster.prepare_mpi_environment()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from e
    return MPI


def local_rank(comm=None) -> int:
    """This process's index among the ranks on its host."""
    MPI = import_mpi()
    comm = comm or MPI.COMM_WORLD
    return comm.Split_type(MPI.COMM_TYPE_SHARED).rank


def make_strategy(gpus=None):
    """The single-replica strategy of one MPI rank: the GPU of its local rank
    among `gpus` (default: the GPUs it sees, `devices.visible_gpus`; ranks
    on a host take turns over them), else the CPU."""
    gpus = devices.visible_gpus() if gpus is None else gpus
    device = gpus[local_rank() % len(gpus)] if gpus else "/cpu:0"
    return tf.distribute.OneDeviceStrategy(device)


# MPI tags of `MpiCollectives.rendezvous` (the collectives use none).
_RENDEZVOUS_TAG = 7000


def _poll(request, deadline: float):
    """The message of a receive request, or None (cancelled) once
    `deadline` (time.monotonic()) passes."""
    while True:
        done, message = request.test()
        if done:
            return message
        if time.monotonic() > deadline:
            request.Cancel()
            return None
        time.sleep(0.01)


class MpiCollectives:
    """Collectives over an MPI communicator (see the module docstring).

    Args:
        strategy: This process's single-replica strategy.
        comm: The communicator (default `MPI.COMM_WORLD`).
        bucket_bytes: 0 (default): one `Allreduce` per dtype per step.
            Otherwise gradients are packed into buckets of about this size in
            reverse layer order, each reduced as soon as its gradients exist,
            so communication can overlap the rest of the backward pass.
        timeout_seconds: An all-reduce that waits longer than this (a rank
            stuck or gone without its process dying) aborts the whole job
            with a one-line error naming this rank. None waits forever.

    Raises:
        ValueError: The strategy has more than one replica.
        ImportError: mpi4py is missing.
    """

    name = "mpi"
    reduces_metrics = True

    def __init__(self, strategy, comm=None, bucket_bytes: int = 0,
                 timeout_seconds: Optional[float] = 300.0):
        if strategy.num_replicas_in_sync != 1:
            raise ValueError(
                "the MPI backend runs one replica per process; got a strategy "
                f"with {strategy.num_replicas_in_sync} replicas (use "
                "tfscale.cluster.mpi.make_strategy() or OneDeviceStrategy)")
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
        MPI = import_mpi()
        self._sum_op = MPI.SUM
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.strategy = strategy
        self.num_workers = self.comm.size
        self.worker_index = self.comm.rank
        self.is_chief = self.worker_index == 0
        self.num_replicas = self.comm.size
        self.bucket_bytes = bucket_bytes
        self._rendezvous = 0
        self._timeout_seconds = timeout_seconds
        self._watchdog = (Watchdog(self.comm, timeout_seconds)
                          if timeout_seconds and self.num_workers > 1
                          else None)
        device = devices.worker_devices(strategy)[0]
        if "GPU" in device.upper() and self.num_workers > 1 and self.is_chief:
            logging.warning(
                "the MPI backend copies each step's gradients from %s to host "
                "memory, sums them with MPI.Allreduce there and copies them "
                "back (no CUDA-aware MPI): on GPUs --backend=mwms (NCCL) is "
                "the fast path", device)

    # ---- in the graph --------------------------------------------------------

    def all_reduce(self, values: Sequence[tf.Tensor]) -> list:
        """Sums of `values` over all ranks (one call per rank, same order)."""
        values = [tf.convert_to_tensor(v) for v in values]
        if self.num_workers == 1:
            return [tf.identity(v) for v in values]
        reduced = [None] * len(values)
        previous = None
        for bucket in self._buckets(values):
            # Every rank must issue the Allreduce calls in the same order:
            # each waits for the one before it.
            deps = [previous] if previous is not None else []
            with tf.control_dependencies(deps):
                total = self._reduce_bucket([values[i] for i in bucket])
            previous = total
            sizes = [values[i].shape.num_elements() for i in bucket]
            for i, part in zip(bucket, tf.split(total, sizes)):
                reduced[i] = tf.reshape(part, values[i].shape)
        return reduced

    def _buckets(self, values) -> list:
        """Index lists, one per Allreduce: per dtype, reverse order, cut at
        `bucket_bytes` (0: no cut)."""
        buckets, current, size, dtype = [], [], 0, None
        for i in reversed(range(len(values))):
            nbytes = values[i].shape.num_elements() * values[i].dtype.size
            if current and (values[i].dtype != dtype or (
                    self.bucket_bytes and size + nbytes > self.bucket_bytes)):
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
            dtype = values[i].dtype
        if current:
            buckets.append(current)
        if not self.bucket_bytes:
            # One buffer per dtype.
            merged = {}
            for bucket in buckets:
                merged.setdefault(values[bucket[0]].dtype, []).extend(bucket)
            buckets = list(merged.values())
        return buckets

    def _reduce_bucket(self, tensors) -> tf.Tensor:
        """The flat sum of `tensors` over all ranks.

        MPI writes the sum into a new, uninitialized tensor (`Empty`, which
        TensorFlow never folds or shares) that `numpy_function` receives as
        an input: returned, it becomes the output tensor without a copy (a
        new NumPy array would be copied). Never in place: the concatenation
        of constants (an evaluation step with no batch) is folded into a
        constant that later calls would read back modified.
        """
        flats = [tf.reshape(t, [-1]) for t in tensors]
        flat = flats[0] if len(flats) == 1 else tf.concat(flats, 0)
        # Both buffers MPI touches are host memory, whatever device the
        # step runs on (a GPU's tensors are copied to the host for it).
        with tf.device("/cpu:0"):
            out = tf.raw_ops.Empty(shape=tf.shape(flat), dtype=flat.dtype)
            total = tf.numpy_function(self._allreduce_into, [flat, out],
                                      flat.dtype, stateful=True)
        return tf.ensure_shape(total, flat.shape)

    def _allreduce_into(self, flat: np.ndarray, out: np.ndarray) -> np.ndarray:
        with self._watching():
            self.comm.Allreduce(flat, out, op=self._sum_op)
        return out

    def reduce_scatter(self, flat) -> tf.Tensor:
        """[N x S] summed over the ranks; rank r gets row r ([S])."""
        flat = tf.convert_to_tensor(flat)
        size = flat.shape.num_elements() // self.num_workers
        return self._host_call(self._reduce_scatter_into, flat, [size])

    def all_gather(self, shard) -> tf.Tensor:
        """[S] of every rank, end to end: [N x S]."""
        shard = tf.convert_to_tensor(shard)
        size = shard.shape.num_elements() * self.num_workers
        return self._host_call(self._all_gather_into, shard, [size])

    def _host_call(self, fn, tensor, shape) -> tf.Tensor:
        with tf.device("/cpu:0"):
            out = tf.raw_ops.Empty(shape=shape, dtype=tensor.dtype)
            result = tf.numpy_function(fn, [tensor, out], tensor.dtype,
                                       stateful=True)
        return tf.ensure_shape(result, shape)

    def _reduce_scatter_into(self, flat, out):
        with self._watching():
            self.comm.Reduce_scatter_block(flat, out, op=self._sum_op)
        return out

    def _all_gather_into(self, shard, out):
        with self._watching():
            self.comm.Allgather(shard, out)
        return out

    def _watching(self):
        return (self._watchdog if self._watchdog is not None
                else contextlib.nullcontext())

    # ---- on the host ---------------------------------------------------------

    def abort(self, code: int) -> None:
        """Ends every rank of the job (mpirun / srun report the failure)."""
        self.comm.Abort(code)

    def agree(self, value: float) -> float:
        if self.num_workers == 1:
            return float(value)
        return float(self.comm.allreduce(float(value), op=self._sum_op))

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather(self, name: str, mine: str, seconds: float) -> dict:
        """Every rank's string on rank 0 (`MPI_Gather`: one small
        collective), its own elsewhere. `name` and `seconds` as the "mwms"
        backend's (the collective timeout bounds it here)."""
        del name, seconds
        if self.num_workers == 1:
            return {0: mine}
        values = self.comm.gather(mine, root=0)
        if values is None:
            return {self.worker_index: mine}
        return dict(enumerate(values))

    def rendezvous(self, what: str, seconds: float) -> None:
        """Every rank has called `rendezvous(what, ...)` as its n-th, or
        `errors.CollectiveMisuse`: point-to-point messages on a tag of
        their own (rank 0 hears every rank, then answers each), polled
        until `seconds` pass, so a rank doing something else is never
        matched into it."""
        if self.num_workers == 1:
            return
        self._rendezvous += 1
        tag = _RENDEZVOUS_TAG + self._rendezvous % 1000
        deadline = time.monotonic() + seconds
        if self.worker_index != 0:
            self.comm.send(what, dest=0, tag=tag)
            verdict = _poll(self.comm.irecv(source=0, tag=tag), deadline)
            if verdict is None:
                raise CollectiveMisuse.of(what, self.worker_index, {0: None},
                                          seconds)
            if verdict:
                raise CollectiveMisuse.of(what, self.worker_index, verdict,
                                          seconds)
            return
        missing = {}
        for rank in range(1, self.num_workers):
            theirs = _poll(self.comm.irecv(source=rank, tag=tag), deadline)
            if theirs != what:
                missing[rank] = theirs
        for rank in range(1, self.num_workers):
            if rank not in missing or missing[rank] is not None:
                self.comm.send(missing, dest=rank, tag=tag)
        if missing:
            raise CollectiveMisuse.of(what, 0, missing, seconds)

    def leave_together(self) -> None:
        """A barrier: `MPI_Finalize`, which every rank calls on its way out
        (`tfscale.cli.leave`), completes whatever communication is still pending.
        A rendezvous first: a rank still in a collective of its own learns
        that this one is leaving."""
        if self.num_workers > 1:
            self.rendezvous("leave_together()",
                            self._timeout_seconds or 24 * 3600.0)
        self.barrier()

    def broadcast_from_chief(self, variables) -> None:
        """Assigns rank 0's values to `variables` on every rank.

        Raises:
            ValueError: The ranks built different variables (the message
                names the rank and the first difference).
        """
        if self.num_workers == 1:
            return
        variables = list(variables)
        signature = [(_name(v), tuple(v.shape), _dtype(v))
                     for v in variables]
        chief = self.comm.bcast(signature, root=0)
        if chief != signature:
            mismatch = _first_difference(chief, signature)
            raise ValueError(
                f"rank {self.worker_index} built other variables than rank "
                f"0: {mismatch} (every rank must build the same model and "
                "optimizer)")
        by_dtype = {}
        for v in variables:
            by_dtype.setdefault(_dtype(v), []).append(v)
        for group in by_dtype.values():
            arrays = [np.asarray(v.numpy()).ravel() for v in group]
            buffer = np.ascontiguousarray(np.concatenate(arrays))
            self.comm.Bcast(buffer, root=0)
            offset = 0
            for v, array in zip(group, arrays):
                part = buffer[offset:offset + array.size]
                v.assign(part.reshape(tuple(v.shape)))
                offset += array.size


class Watchdog:
    """Aborts the MPI job when one all-reduce waits longer than a limit.

    MPI has no collective timeout: a rank that stops calling (stuck, or
    stopped by a debugger) would hang the others forever. mpi4py releases
    the GIL while it waits, so a thread can watch the clock; `comm.Abort`
    ends every rank (mpirun / srun then report the job failed).
    """

    def __init__(self, comm, timeout_seconds: float):
        self._comm = comm
        self._timeout = timeout_seconds
        self._deadline = None
        threading.Thread(target=self._watch, daemon=True,
                         name="tfscale-mpi-watchdog").start()

    def __enter__(self):
        self._deadline = time.monotonic() + self._timeout

    def __exit__(self, *exc):
        self._deadline = None

    def _watch(self):
        while True:
            time.sleep(min(1.0, self._timeout / 10))
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(
                    f"tfscale: error: rank {self._comm.rank}: an all-reduce "
                    f"has waited {self._timeout:g} s (the collective "
                    "timeout): another rank is stuck or gone; aborting the "
                    "job\n")
                sys.stderr.flush()
                self._comm.Abort(1)


def _name(variable) -> str:
    return getattr(variable, "path", None) or getattr(variable, "name", "?")


def _first_difference(chief: list, own: list) -> str:
    for i, (a, b) in enumerate(zip(chief, own)):
        if a != b:
            return f"variable {i} is {b} here and {a} on rank 0"
    return f"{len(own)} variables here, {len(chief)} on rank 0"



def _dtype(variable) -> str:
    return tf.as_dtype(variable.dtype).name
