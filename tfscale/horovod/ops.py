"""Horovod's collectives on MPI, with their gradients beside them: the API
(`allreduce`, `grouped_allreduce`, `allgather`, `broadcast`, `join`).

Each call agrees with the other ranks on what is being done
(`protocol.py`), then moves the data in one MPI call (`Allreduce`,
`Allgatherv`, `Bcast`) of one fused buffer per dtype (`mpi_buffers.py`),
through host memory (`host.py`). Results come back on the device the input
was on, as Horovod's do.
"""

from typing import Optional, Sequence

import tensorflow as tf

from tfscale import _compat
from tfscale.horovod import _state, host, mpi_buffers, protocol
from tfscale.horovod.protocol import (  # noqa: F401 (the API's constants)
    Adasum, Average, CollectiveMismatchError, Max, Min, Product, Sum)


class ProcessSet:
    """Horovod's process set; only the global one (all ranks) exists."""

    def __init__(self, ranks=None):
        if ranks is not None:
            raise NotImplementedError(
                "tfscale.horovod has no process sets: every collective runs "
                "on all ranks (start separate jobs for separate groups)")

    def size(self) -> int:
        return _state.size()

    def rank(self) -> int:
        return _state.rank()


global_process_set = ProcessSet()


def check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(
            "tfscale.horovod has no process sets: pass "
            "process_set=hvd.global_process_set (all ranks)")


def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please "
                         "provide only one of them.")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError(
            "tfscale.horovod has no Adasum: use op=hvd.Average (with a "
            "large-batch optimizer such as tfscale's LAMB for the same aim)")
    if op not in protocol.OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}: use hvd.Average, "
                         "hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


def _reduce_flat(tensors: Sequence[tf.Tensor], op: int, name: str) -> list:
    """The element-wise `op` (Sum for Average) over all ranks of tensors of
    one dtype, through one fused buffer."""
    mpi_op = Sum if op == Average else op
    if tf.executing_eagerly() and len(tensors) == 1:
        # On the host MPI reads the tensor's own buffer: no copy.
        tensor = tensors[0]
        out, buffer = _compat.new_host_tensor(tensor.shape, tensor.dtype)
        mpi_buffers.allreduce(host.host_view(tensor).reshape(-1),
                               buffer.reshape(-1), [tensor.shape], mpi_op,
                               name)
        return [out]
    if len(tensors) == 1:
        flat = tf.reshape(tensors[0], [-1])
    else:
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
    if tf.executing_eagerly():
        total, buffer = _compat.new_host_tensor(flat.shape, flat.dtype)
        mpi_buffers.allreduce(host.host_view(flat), buffer,
                               [tuple(t.shape) for t in tensors], mpi_op, name)
    else:
        host.refuse_xla(name)
        total = host.host_numpy_function(
            lambda f, s, o: mpi_buffers.allreduce(
                f, o, mpi_buffers.shapes_from(s), mpi_op, name),
            [flat, host.encode_shapes(tensors)], flat, "HorovodAllreduce")
        total = tf.ensure_shape(total, flat.shape)
    if len(tensors) == 1:
        return [tf.reshape(total, tf.shape(tensors[0]))]
    sizes = [tf.size(t) for t in tensors]
    return [tf.reshape(part, tf.shape(t))
            for part, t in zip(tf.split(total, sizes), tensors)]


def _scaled(tensor, factor):
    if isinstance(factor, (int, float)) and factor == 1.0:
        return tensor
    return tensor * tf.cast(factor, tensor.dtype)


def _average(tensor, size: int):
    if tensor.dtype.is_integer:
        return tensor // size
    return tensor / tf.cast(size, tensor.dtype)


def _grouped(tensors: Sequence[tf.Tensor], op: int, name: str,
             prescale=1.0, postscale=1.0) -> list:
    """Reduces `tensors` (any dtypes): one fused MPI call per dtype, in the
    order the dtypes first appear; differentiable for Sum and Average."""
    state = _state.get()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    floating = all(t.dtype.is_floating for t in tensors)
    if floating and (not tf.executing_eagerly()
                     or _compat.gradient_may_be_recorded(tensors)):
        @tf.custom_gradient
        def reduce(*xs):
            ys = _grouped_forward(state, xs, op, name, prescale, postscale)

            def grad(*dys):
                if op not in (Sum, Average):
                    raise NotImplementedError(
                        f"tfscale.horovod: the gradient of allreduce with "
                        f"op={protocol.OP_NAMES[op]} is not defined "
                        "(Horovod's is not either)")
                return _grouped(dys, op, name + "_grad", prescale, postscale)
            return ys, grad
        return list(reduce(*tensors))
    return _grouped_forward(state, tensors, op, name, prescale, postscale)


def _grouped_forward(state, tensors, op, name, prescale, postscale):
    tensors = [_scaled(t, prescale) for t in tensors]
    if state.size == 1:
        out = [tf.identity(t) for t in tensors]
    else:
        by_dtype = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        out = [None] * len(tensors)
        for indices in by_dtype.values():
            group = [tensors[i] for i in indices]
            for i, reduced in zip(indices, _reduce_flat(group, op, name)):
                out[i] = reduced
    if op == Average:
        out = [_average(t, state.size) for t in out]
    return [_scaled(t, postscale) for t in out]


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None,
              process_set=global_process_set, ignore_name_scope=False):
    """The reduction of `tensor` over all ranks (Horovod's `allreduce`).

    Args:
        tensor: A tensor, or `tf.IndexedSlices` (gathered, not summed, as
            Horovod does; Average divides the values by size()).
        average: Deprecated form of `op` (True: Average, False: Sum).
        device_dense, device_sparse, ignore_name_scope: Accepted for
            Horovod's signature; the MPI call runs on the host.
        compression: `Compression.none` (default) or `Compression.fp16`.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor, postscale_factor: Multiply the tensor before and
            the result after the reduction.
        name: Shown in errors.
        process_set: Only `global_process_set`.

    Returns:
        A tensor of the same shape and dtype as `tensor` on every rank.

    Raises:
        ValueError: Called before init(); on every rank, ranks disagree on
            shapes, dtypes or the collective (CollectiveMismatchError).
        NotImplementedError: Adasum, or another process set.
    """
    from tfscale.horovod.compression import Compression
    check_process_set(process_set)
    op = resolve_op(op, average)
    state = _state.get()
    name = name or "allreduce"
    compression = compression or Compression.none
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Sum, Average):
            raise NotImplementedError(
                "tfscale.horovod: sparse allreduce supports only Sum and "
                "Average (as Horovod's); pass sparse_as_dense=True for "
                f"op={protocol.OP_NAMES[op]}")
        values = allgather(_scaled(tensor.values, prescale_factor),
                           name=name + "_values")
        indices = allgather(tensor.indices, name=name + "_indices")
        if op == Average:
            values = _average(values, state.size)
        return tf.IndexedSlices(_scaled(values, postscale_factor), indices,
                                dense_shape=tensor.dense_shape)
    tensor = tf.convert_to_tensor(tensor)
    compressed, context = compression.compress(tensor)
    reduced = _grouped([compressed], op, name, prescale_factor,
                       postscale_factor)[0]
    return host.placed_like(compression.decompress(reduced, context), tensor)


def grouped_allreduce(tensors, average=None, device_dense="",
                      device_sparse="", compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, name=None):
    """`allreduce` of each tensor, fused into one MPI call per dtype."""
    from tfscale.horovod.compression import Compression
    check_process_set(process_set)
    op = resolve_op(op, average)
    _state.get()
    compression = compression or Compression.none
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, compression=compression,
                          prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, name=name)
                for t in tensors]
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    compressed, contexts = [], []
    for t in tensors:
        c, context = compression.compress(t)
        compressed.append(c)
        contexts.append(context)
    reduced = _grouped(compressed, op, name or "grouped_allreduce",
                       prescale_factor, postscale_factor)
    return [host.placed_like(compression.decompress(r, c), t)
            for r, c, t in zip(reduced, contexts, tensors)]


def allgather(tensor, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Every rank's `tensor` concatenated on the first dimension, in rank
    order; the first dimensions may differ between ranks.

    Raises:
        CollectiveMismatchError: (on every rank) other dtypes or other
            dimensions after the first.
    """
    check_process_set(process_set)
    state = _state.get()
    tensor = tf.convert_to_tensor(tensor)
    name = name or "allgather"
    if tensor.shape.rank == 0:
        raise ValueError(f"tfscale.horovod: allgather {name!r} needs a "
                         "tensor of rank >= 1, got a scalar")

    def forward(x):
        if state.size == 1:
            return tf.identity(x)
        if tf.executing_eagerly():
            with tf.device(host.HOST):
                return tf.convert_to_tensor(
                    mpi_buffers.allgather(host.host_view(x), name))
        host.refuse_xla(name)
        with tf.device(host.HOST):
            gathered = tf.numpy_function(
                lambda a: mpi_buffers.allgather(a, name), [x], x.dtype,
                stateful=True, name="HorovodAllgather")
        return tf.ensure_shape(gathered, [None] + x.shape[1:].as_list())

    def backward(x, dy):
        # Every rank's slice of the summed gradient is its own part.
        summed = _grouped([dy], Sum, name + "_grad")[0]
        firsts = allgather(tf.shape(x, out_type=tf.int64)[:1],
                           name=name + "_grad_sizes")
        start = tf.reduce_sum(firsts[:state.rank])
        return summed[start:start + tf.shape(x, out_type=tf.int64)[0]]
    return host.placed_like(_differentiable(tensor, forward, backward), tensor)


def _differentiable(tensor, forward, backward):
    """`forward(tensor)`; for floating tensors with `backward(x, dy)` as its
    gradient."""
    if not tensor.dtype.is_floating:
        return forward(tensor)

    @tf.custom_gradient
    def op(x):
        return forward(x), lambda dy: backward(x, dy)
    return op(tensor)


def broadcast(tensor, root_rank: int, name=None,
              process_set=global_process_set, ignore_name_scope=False):
    """`tensor` of rank `root_rank`, on every rank.

    Raises:
        ValueError: `root_rank` out of range.
        CollectiveMismatchError: (on every rank) other shapes, dtypes or
            roots.
    """
    check_process_set(process_set)
    state = _state.get()
    check_root(root_rank, state)
    tensor = tf.convert_to_tensor(tensor)
    name = name or "broadcast"

    def forward(x):
        if state.size == 1:
            return tf.identity(x)
        if tf.executing_eagerly():
            out, buffer = _compat.new_host_tensor(x.shape, x.dtype)
            mpi_buffers.broadcast(host.host_view(x), buffer, root_rank, name)
            return out
        host.refuse_xla(name)
        result = host.host_numpy_function(
            lambda a, o: mpi_buffers.broadcast(a, o, root_rank, name), [x], x,
            "HorovodBroadcast")
        return tf.ensure_shape(result, x.shape)

    def backward(x, dy):
        summed = _grouped([dy], Sum, name + "_grad")[0]
        return summed if state.rank == root_rank else summed * 0
    return host.placed_like(_differentiable(tensor, forward, backward), tensor)


def check_root(root_rank, state) -> None:
    if not 0 <= int(root_rank) < state.size:
        raise ValueError(f"tfscale.horovod: root_rank={root_rank} is out of "
                         f"range for {state.size} ranks")


def join() -> int:
    """Horovod's `join`: this rank has run out of data. Until every rank
    has joined, its share of the others' allreduces is zeros (Average still
    divides by size()). Returns the rank that joined last.

    Eager only (call it after the training loop, as Horovod's examples do).
    """
    state = _state.get()
    if not tf.executing_eagerly():
        raise NotImplementedError("tfscale.horovod: call join() eagerly, "
                                  "outside tf.function")
    if state.check != "every":
        raise NotImplementedError(
            "tfscale.horovod: join() needs every collective checked (the "
            "joined ranks learn each allreduce from its check): unset "
            "TFSCALE_HOROVOD_CHECK")
    return mpi_buffers.join_loop()
