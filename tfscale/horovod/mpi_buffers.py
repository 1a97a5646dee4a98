"""MPI on NumPy buffers: the calls `ops` makes once the ranks agree
(`protocol.agree`), one fused buffer per dtype, and `join`'s loop. 16-bit
floats travel as 16-bit words and reduce with their own MPI operation (MPI
has no half-precision arithmetic)."""

from typing import List

import numpy as np

from tfscale.horovod import _state, protocol
from tfscale.horovod.protocol import Average, Max, Min, Product, Sum

HALF = ("float16", "bfloat16")


def mpi_op(state, op: int, dtype):
    """The MPI reduction for `op` on `dtype` (16-bit floats get their own,
    since MPI has no half-precision arithmetic)."""
    MPI = state.mpi
    name = np.dtype(dtype).name
    if name not in HALF:
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


def buffer(state, array: np.ndarray):
    """What mpi4py accepts for `array` (16-bit floats as raw 16-bit words)."""
    if array.dtype.name in HALF:
        return [array.view(np.uint16), state.mpi.UINT16_T]
    return array


def shapes_from(encoded: np.ndarray) -> List[tuple]:
    """[ndim0, dims0..., ndim1, dims1...] -> shapes."""
    shapes, i = [], 0
    encoded = [int(x) for x in encoded]
    while i < len(encoded):
        n = encoded[i]
        shapes.append(tuple(encoded[i + 1:i + 1 + n]))
        i += 1 + n
    return shapes


def allgather(array, name):
    state = _state.get()
    with state.lock, protocol.watched(state):
        table = protocol.agree(state, protocol.ALLGATHER, name,
                               [array.shape], array.dtype)
        firsts = table[:, 6]
        inner = int(np.prod(array.shape[1:], dtype=np.int64))
        out = np.empty((int(firsts.sum()),) + array.shape[1:], array.dtype)
        counts = [int(f) * inner for f in firsts]
        sendbuf = np.ascontiguousarray(array)
        if array.dtype.name in HALF:
            sendbuf, out_view = sendbuf.view(np.uint16), out.view(np.uint16)
        else:
            out_view = out
        state.comm.Allgatherv(sendbuf, [out_view, counts])
    return out


def broadcast(array, out, root, name):
    state = _state.get()
    with state.lock, protocol.watched(state):
        protocol.agree(state, protocol.BROADCAST, name, [array.shape],
                       array.dtype, root=root)
        if state.rank == root:
            np.copyto(out, array)
        state.comm.Bcast(buffer(state, out), root=root)
    return out


def join_loop() -> int:
    """This rank has no more data: join the others' allreduces with zeros
    until every rank has joined; returns the rank that joined last."""
    state = _state.get()
    if state.comm is None:
        return 0
    joined_at = state.sequence + 1
    while True:
        with state.lock, protocol.watched(state):
            table = protocol.agree(state, protocol.JOIN, "join", [], None)
            joins = table[:, 0] == protocol.JOIN
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
            state.comm.Allreduce(buffer(state, zeros), buffer(state, out),
                                 op=mpi_op(state, int(row[1]), zeros.dtype))


def _announce_size_if_joined(state, table, flat) -> None:
    """When ranks have joined, the first active rank tells them the size
    and dtype of the buffer to add zeros to (see `join_loop`)."""
    if table is None:  # unchecked: no rank can have joined (join refuses)
        return
    joins = table[:, 0] == protocol.JOIN
    if not joins.any():
        return
    first = int(np.flatnonzero(~joins)[0])
    state.comm.bcast((flat.size, flat.dtype) if state.rank == first else None,
                     root=first)


def allreduce(flat, out, shapes, op, name):
    state = _state.get()
    with state.lock, protocol.watched(state):
        table = protocol.agree(state, protocol.ALLREDUCE, name, shapes,
                               flat.dtype, op)
        _announce_size_if_joined(state, table, flat)
        state.comm.Allreduce(buffer(state, flat), buffer(state, out),
                             op=mpi_op(state, op, flat.dtype))
    return out
