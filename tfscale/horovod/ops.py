"""Horovod's collectives on MPI, with their gradients beside them.

Every collective first agrees with the other ranks on what is being done:
one `Allgather` of a fixed-size row (kind, name, reduction, dtype, root, a
checksum of the shapes, a sequence number), as Horovod's coordinator does. Ranks that pass
different shapes, dtypes or collectives then all raise the same one-line
error naming the op, the ranks and their shapes, instead of hanging or
crashing inside MPI; the row also carries `join()`'s "no more data" flag.
The data then moves in one MPI call (`Allreduce`, `Allgatherv`, `Bcast`)
of one fused buffer per dtype.

Every buffer MPI reads or writes is host memory, made as such: eagerly, the
input's host view (its own buffer when it lives on the host, a copy from a
GPU otherwise) and a new tensor pinned to the host that MPI fills in place
(`_compat.new_host_tensor`); inside a `tf.function`, `tf.numpy_function`s
pinned to the host, which TensorFlow's automatic control dependencies keep
in program order, so all ranks issue them in the same order. Results come
back on the device the input was on, as Horovod's do. (An output made on a
GPU and filled through its host copy would come back uninitialised.)
"""

import zlib
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfscale import _compat
from tfscale.horovod import _state

# Horovod's reduction constants (the same values as horovod.tensorflow's).
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min",
             Max: "Max", Product: "Product"}

_ALLREDUCE, _ALLGATHER, _BROADCAST, _JOIN = 1, 2, 3, 4
_KIND_NAMES = {_ALLREDUCE: "allreduce", _ALLGATHER: "allgather",
               _BROADCAST: "broadcast", _JOIN: "join"}
# A row: kind, op, dtype, root, tensors, checksum of the shapes that must
# agree, the first dimension (allgather), the collective's sequence number,
# checksum of its name (as Horovod's coordinator matches ops by name).
_ROW = 9
_MUST_AGREE = [0, 1, 2, 3, 4, 5, 8]


class CollectiveMismatchError(ValueError):
    """Ranks issued different collectives, or passed different tensors."""


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


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(
            "tfscale.horovod has no process sets: pass "
            "process_set=hvd.global_process_set (all ranks)")


def _resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please "
                         "provide only one of them.")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError(
            "tfscale.horovod has no Adasum: use op=hvd.Average (with a "
            "large-batch optimizer such as tfscale's LAMB for the same aim)")
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}: use hvd.Average, "
                         "hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


# ---- agreeing on the collective ---------------------------------------------

def _describe(dtype, shape) -> str:
    return f"{np.dtype(dtype).name}[{', '.join(str(d) for d in shape)}]"


def _checksum(parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


# With TFSCALE_HOROVOD_CHECK=first: how many calls of each name agree
# before the rest of that name's calls go unchecked.
FIRST_CHECKS = 3


def _trusted(state, kind: int, name: str) -> bool:
    """Whether this allreduce or broadcast may skip the agreement (mode
    "first", and its name agreed FIRST_CHECKS times already). Every rank
    decides alike: the counts only grow on calls that agreed everywhere."""
    if state.check != "first" or kind not in (_ALLREDUCE, _BROADCAST):
        return False
    key = (kind, name)
    seen = state.checked.get(key, 0)
    if seen >= FIRST_CHECKS:
        state.sequence += 1
        return True
    state.checked[key] = seen + 1
    return False


def _agree(state, kind: int, name: str, shapes: Sequence[tuple], dtype,
           op: int = 0, root: int = 0) -> Optional[np.ndarray]:
    """Exchanges this rank's row with every rank's; returns the table (None
    when the call is trusted without it: `_trusted`).

    Raises:
        CollectiveMismatchError: (on every rank) the ranks disagree.
    """
    if _trusted(state, kind, name):
        return None
    state.sequence += 1
    if kind == _ALLGATHER:
        must_agree = [tuple(s[1:]) for s in shapes]
        first = shapes[0][0] if shapes and shapes[0] else 1
    else:
        must_agree = [tuple(s) for s in shapes]
        first = 0
    dtype_code = _checksum(np.dtype(dtype).name) if dtype is not None else 0
    row = np.array([kind, op, dtype_code, root, len(shapes),
                    _checksum(must_agree), first, state.sequence,
                    _checksum(name)], np.int64)
    table = np.empty((state.size, _ROW), np.int64)
    state.comm.Allgather(row, table)
    joined = table[:, 0] == _JOIN
    active = table[~joined]
    if joined.any() and len(active):
        if np.any(active[:, 0] != _ALLREDUCE):
            bad = int(active[active[:, 0] != _ALLREDUCE][0, 0])
            raise CollectiveMismatchError(
                f"tfscale.horovod: {_KIND_NAMES.get(bad, '?')} after a rank "
                "called join(): only allreduce (Sum or Average) runs while "
                "ranks have joined")
        if np.any(active[:, 1] != Sum):
            raise CollectiveMismatchError(
                "tfscale.horovod: allreduce with Min, Max or Product after a "
                "rank called join(): joined ranks add zeros, so only Sum and "
                "Average are defined")
    if np.any(table[:, 7] != table[0, 7]):
        behind = int(np.argmin(table[:, 7]))
        ahead = int(np.argmax(table[:, 7]))
        raise CollectiveMismatchError(
            f"tfscale.horovod: rank {ahead} is at collective "
            f"{int(table[ahead, 7])}, rank {behind} at "
            f"{int(table[behind, 7])} (a rank re-initialized, or left a "
            "collective half-done)")
    keys = active[:, _MUST_AGREE]
    if len(keys) and np.any(keys != keys[0]):
        ranks = np.flatnonzero(~joined)
        differs = np.flatnonzero(np.any(keys != keys[0], axis=1))
        _raise_mismatch(state, int(ranks[0]), int(ranks[differs[0]]), kind,
                        name, shapes, dtype, op, root)
    return table


def _raise_mismatch(state, first, other, kind, name, shapes, dtype, op,
                    root):
    """Gathers every rank's description and raises the same error on all,
    naming rank `first` and the first rank `other` that differs from it."""
    mine = (_KIND_NAMES[kind], name, _OP_NAMES.get(op, "?"), root,
            [_describe(dtype, s) for s in shapes])
    everyone = state.comm.allgather(mine)
    reference, theirs = everyone[first], everyone[other]

    def said(rank, d):
        kind_name, op_name, tensors = d[0], d[1], d[4]
        shown = tensors[0] if len(tensors) == 1 else f"[{', '.join(tensors)}]"
        return f"rank {rank} called {kind_name} {op_name!r} with {shown}"

    if reference[0] != theirs[0] or reference[1] != theirs[1]:
        detail = (f"{said(first, reference)}, {said(other, theirs)} (every "
                  "rank must issue the same collectives, by name, in the "
                  "same order)")
    elif reference[4] != theirs[4]:
        detail = (f"{said(first, reference)}, {said(other, theirs)} (every "
                  "rank must pass the same shapes and dtypes"
                  + (", except allgather's first dimension)"
                     if kind == _ALLGATHER else ")"))
    elif reference[2] != theirs[2]:
        detail = (f"rank {first} reduces with op={reference[2]}, rank "
                  f"{other} with op={theirs[2]}")
    else:
        detail = (f"rank {first} broadcasts from root {reference[3]}, rank "
                  f"{other} from root {theirs[3]}")
    raise CollectiveMismatchError(
        f"tfscale.horovod: mismatched {reference[0]} {reference[1]!r}: "
        f"{detail}")


def _watched(state):
    return state.watchdog if state.watchdog is not None else _NoWatch()


class _NoWatch:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- MPI on NumPy buffers ---------------------------------------------------

_HALF = ("float16", "bfloat16")


def _mpi_op(state, op: int, dtype):
    """The MPI reduction for `op` on `dtype` (16-bit floats get their own,
    since MPI has no half-precision arithmetic)."""
    MPI = state.mpi
    name = np.dtype(dtype).name
    if name not in _HALF:
        return {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX,
                Product: MPI.PROD}[op]
    cache = state.__dict__.setdefault("half_ops", {})
    key = (name, op)
    if key not in cache:
        ufunc = {Sum: np.add, Average: np.add, Min: np.minimum,
                 Max: np.maximum, Product: np.multiply}[op]
        np_dtype = np.dtype(dtype)

        def reduce(inbuf, inoutbuf, datatype):
            a = np.frombuffer(inbuf, dtype=np_dtype)
            b = np.frombuffer(inoutbuf, dtype=np_dtype)
            ufunc(a, b, out=b)
        cache[key] = MPI.Op.Create(reduce, commute=True)
    return cache[key]


def _buffer(state, array: np.ndarray):
    """What mpi4py accepts for `array` (16-bit floats as raw 16-bit words)."""
    if array.dtype.name in _HALF:
        return [array.view(np.uint16), state.mpi.UINT16_T]
    return array


def _shapes_from(encoded: np.ndarray) -> List[tuple]:
    """[ndim0, dims0..., ndim1, dims1...] -> shapes."""
    shapes, i = [], 0
    encoded = [int(x) for x in encoded]
    while i < len(encoded):
        n = encoded[i]
        shapes.append(tuple(encoded[i + 1:i + 1 + n]))
        i += 1 + n
    return shapes


def _np_allgather(array, name):
    state = _state.get()
    with state.lock, _watched(state):
        table = _agree(state, _ALLGATHER, name, [array.shape], array.dtype)
        firsts = table[:, 6]
        inner = int(np.prod(array.shape[1:], dtype=np.int64))
        out = np.empty((int(firsts.sum()),) + array.shape[1:], array.dtype)
        counts = [int(f) * inner for f in firsts]
        sendbuf = np.ascontiguousarray(array)
        if array.dtype.name in _HALF:
            sendbuf, out_view = sendbuf.view(np.uint16), out.view(np.uint16)
        else:
            out_view = out
        state.comm.Allgatherv(sendbuf, [out_view, counts])
    return out


def _np_broadcast(array, out, root, name):
    state = _state.get()
    with state.lock, _watched(state):
        _agree(state, _BROADCAST, name, [array.shape], array.dtype, root=root)
        if state.rank == root:
            np.copyto(out, array)
        state.comm.Bcast(_buffer(state, out), root=root)
    return out


def join_loop() -> int:
    """This rank has no more data: join the others' allreduces with zeros
    until every rank has joined; returns the rank that joined last."""
    state = _state.get()
    if state.comm is None:
        return 0
    joined_at = state.sequence + 1
    while True:
        with state.lock, _watched(state):
            table = _agree(state, _JOIN, "join", [], None)
            joins = table[:, 0] == _JOIN
            if joins.all():
                starts = state.comm.allgather(joined_at)
                latest = max(starts)
                return max(r for r, s in enumerate(starts) if s == latest)
            row = table[~joins][0]
            # The others reduce a buffer whose size and dtype only they
            # know: ask once (every rank takes part).
            count, dtype = state.comm.bcast(
                None, root=int(np.flatnonzero(~joins)[0]))
            zeros = np.zeros(count, dtype)
            out = np.empty_like(zeros)
            state.comm.Allreduce(_buffer(state, zeros), _buffer(state, out),
                                 op=_mpi_op(state, int(row[1]), zeros.dtype))


def _announce_size_if_joined(state, table, flat) -> None:
    """When ranks have joined, the first active rank tells them the size
    and dtype of the buffer to add zeros to (see `join_loop`)."""
    if table is None:  # unchecked: no rank can have joined (join refuses)
        return
    joins = table[:, 0] == _JOIN
    if not joins.any():
        return
    first = int(np.flatnonzero(~joins)[0])
    state.comm.bcast((flat.size, flat.dtype) if state.rank == first else None,
                     root=first)


def _np_allreduce_joinable(flat, out, shapes, op, name):
    state = _state.get()
    with state.lock, _watched(state):
        table = _agree(state, _ALLREDUCE, name, shapes, flat.dtype, op)
        _announce_size_if_joined(state, table, flat)
        state.comm.Allreduce(_buffer(state, flat), _buffer(state, out),
                             op=_mpi_op(state, op, flat.dtype))
    return out


# ---- the TensorFlow boundary ------------------------------------------------

def _encode_shapes(tensors) -> tf.Tensor:
    parts = []
    for t in tensors:
        shape = tf.shape(t, out_type=tf.int64)
        parts += [tf.reshape(tf.size(shape, out_type=tf.int64), [1]), shape]
    return tf.concat(parts, 0)


# ---- host buffers -------------------------------------------------------

_HOST = "/cpu:0"


def host_view(tensor: tf.Tensor) -> np.ndarray:
    """An eager tensor's values in host memory, for MPI to read: the
    tensor's own buffer when it is on the host, a copy from a device."""
    return np.asarray(tensor)


def _placed_like(result, original):
    """Eagerly, `result` on the device `original` was on (Horovod returns
    results where the inputs were); in graphs the placer does this."""
    device = getattr(original, "device", "")
    if not tf.executing_eagerly() or not device or \
            getattr(result, "device", device) == device:
        return result
    with tf.device(device):
        if isinstance(result, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(result.values),
                                    tf.identity(result.indices),
                                    result.dense_shape)
        return tf.identity(result)


def _host_numpy_function(fn, inputs, like, name):
    """`fn(*inputs, out)` in a `tf.numpy_function` on the host (graph
    mode), `out` an uninitialised host tensor shaped as `like` for MPI to
    write and `fn` to return: it becomes the result without a copy (a new
    NumPy array would be copied). `Empty` is never folded or shared, so
    every call gets its own."""
    with tf.device(_HOST):
        out = tf.raw_ops.Empty(shape=tf.shape(like), dtype=like.dtype)
        return tf.numpy_function(fn, [*inputs, out], like.dtype,
                                 stateful=True, name=name)


def _reduce_flat(tensors: Sequence[tf.Tensor], op: int, name: str) -> list:
    """The element-wise `op` (Sum for Average) over all ranks of tensors of
    one dtype, through one fused buffer."""
    mpi_op = Sum if op == Average else op
    if tf.executing_eagerly() and len(tensors) == 1:
        # On the host MPI reads the tensor's own buffer: no copy.
        tensor = tensors[0]
        out, buffer = _compat.new_host_tensor(tensor.shape, tensor.dtype)
        _np_allreduce_joinable(host_view(tensor).reshape(-1),
                               buffer.reshape(-1), [tensor.shape], mpi_op,
                               name)
        return [out]
    if len(tensors) == 1:
        flat = tf.reshape(tensors[0], [-1])
    else:
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)
    if tf.executing_eagerly():
        total, buffer = _compat.new_host_tensor(flat.shape, flat.dtype)
        _np_allreduce_joinable(host_view(flat), buffer,
                               [tuple(t.shape) for t in tensors], mpi_op, name)
    else:
        _refuse_xla(name)
        total = _host_numpy_function(
            lambda f, s, o: _np_allreduce_joinable(f, o, _shapes_from(s),
                                                   mpi_op, name),
            [flat, _encode_shapes(tensors)], flat, "HorovodAllreduce")
        total = tf.ensure_shape(total, flat.shape)
    if len(tensors) == 1:
        return [tf.reshape(total, tf.shape(tensors[0]))]
    sizes = [tf.size(t) for t in tensors]
    return [tf.reshape(part, tf.shape(t))
            for part, t in zip(tf.split(total, sizes), tensors)]


def _refuse_xla(name: str) -> None:
    if _compat.in_xla_context():
        raise ValueError(
            f"tfscale.horovod: {name!r} cannot run inside an XLA-compiled "
            "function (jit_compile=True): MPI is called from the host. "
            "Compile the Keras model with jit_compile=False, or use "
            "tfscale's Trainer, whose --xla compiles the step and reduces "
            "outside it")


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
                        f"op={_OP_NAMES[op]} is not defined (Horovod's is "
                        "not either)")
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
    _check_process_set(process_set)
    op = _resolve_op(op, average)
    state = _state.get()
    name = name or "allreduce"
    compression = compression or Compression.none
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Sum, Average):
            raise NotImplementedError(
                "tfscale.horovod: sparse allreduce supports only Sum and "
                "Average (as Horovod's); pass sparse_as_dense=True for "
                f"op={_OP_NAMES[op]}")
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
    return _placed_like(compression.decompress(reduced, context), tensor)


def grouped_allreduce(tensors, average=None, device_dense="",
                      device_sparse="", compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, name=None):
    """`allreduce` of each tensor, fused into one MPI call per dtype."""
    from tfscale.horovod.compression import Compression
    _check_process_set(process_set)
    op = _resolve_op(op, average)
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
    return [_placed_like(compression.decompress(r, c), t)
            for r, c, t in zip(reduced, contexts, tensors)]


def allgather(tensor, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Every rank's `tensor` concatenated on the first dimension, in rank
    order; the first dimensions may differ between ranks.

    Raises:
        CollectiveMismatchError: (on every rank) other dtypes or other
            dimensions after the first.
    """
    _check_process_set(process_set)
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
            with tf.device(_HOST):
                return tf.convert_to_tensor(_np_allgather(host_view(x), name))
        _refuse_xla(name)
        with tf.device(_HOST):
            gathered = tf.numpy_function(lambda a: _np_allgather(a, name),
                                         [x], x.dtype, stateful=True,
                                         name="HorovodAllgather")
        return tf.ensure_shape(gathered, [None] + x.shape[1:].as_list())

    def backward(x, dy):
        # Every rank's slice of the summed gradient is its own part.
        summed = _grouped([dy], Sum, name + "_grad")[0]
        firsts = allgather(tf.shape(x, out_type=tf.int64)[:1],
                           name=name + "_grad_sizes")
        start = tf.reduce_sum(firsts[:state.rank])
        return summed[start:start + tf.shape(x, out_type=tf.int64)[0]]
    return _placed_like(_differentiable(tensor, forward, backward), tensor)


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
    _check_process_set(process_set)
    state = _state.get()
    _check_root(root_rank, state)
    tensor = tf.convert_to_tensor(tensor)
    name = name or "broadcast"

    def forward(x):
        if state.size == 1:
            return tf.identity(x)
        if tf.executing_eagerly():
            out, buffer = _compat.new_host_tensor(x.shape, x.dtype)
            _np_broadcast(host_view(x), buffer, root_rank, name)
            return out
        _refuse_xla(name)
        result = _host_numpy_function(
            lambda a, o: _np_broadcast(a, o, root_rank, name), [x], x,
            "HorovodBroadcast")
        return tf.ensure_shape(result, x.shape)

    def backward(x, dy):
        summed = _grouped([dy], Sum, name + "_grad")[0]
        return summed if state.rank == root_rank else summed * 0
    return _placed_like(_differentiable(tensor, forward, backward), tensor)


def _check_root(root_rank, state) -> None:
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
    return join_loop()
