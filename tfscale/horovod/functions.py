"""Collectives on variables and Python objects, built on `ops`."""

import tensorflow as tf

from tfscale.horovod import _state, ops


def broadcast_variables(variables, root_rank: int,
                        process_set=ops.global_process_set, inplace=False):
    """Assigns rank `root_rank`'s values to `variables` on every rank: one
    broadcast per dtype. Eagerly and inside `tf.function` (Horovod's
    examples call it in their compiled step on the first batch).

    Returns:
        The group of assignments (inside a `tf.function`), else None.
    """
    ops.check_process_set(process_set)
    state = _state.get()
    ops.check_root(root_rank, state)
    variables = list(variables)
    if state.size == 1 or not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    by_dtype = {}
    for v in variables:
        by_dtype.setdefault(tf.as_dtype(v.dtype), []).append(v)
    assignments = []
    for dtype, group in by_dtype.items():
        values = [tf.convert_to_tensor(v) for v in group]
        flat = tf.concat([tf.reshape(x, [-1]) for x in values], 0)
        received = ops.broadcast(flat, root_rank,
                                 name=f"broadcast_variables.{dtype.name}")
        sizes = [tf.size(x) for x in values]
        for v, x, part in zip(group, values, tf.split(received, sizes)):
            assignments.append(v.assign(tf.reshape(part, tf.shape(x))))
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assignments if a is not None])


def broadcast_object(obj, root_rank: int = 0, session=None, name=None,
                     process_set=ops.global_process_set):
    """Rank `root_rank`'s picklable `obj`, on every rank (eager only)."""
    ops.check_process_set(process_set)
    state = _state.get()
    ops.check_root(root_rank, state)
    _refuse_graph("broadcast_object")
    if state.size == 1:
        return obj
    return state.comm.bcast(obj, root=root_rank)


def allgather_object(obj, session=None, name=None,
                     process_set=ops.global_process_set) -> list:
    """Every rank's picklable `obj`, as a list in rank order (eager only)."""
    ops.check_process_set(process_set)
    state = _state.get()
    _refuse_graph("allgather_object")
    if state.size == 1:
        return [obj]
    return state.comm.allgather(obj)


def _refuse_graph(what: str) -> None:
    if not tf.executing_eagerly():
        raise NotImplementedError(
            f"tfscale.horovod: call {what}() eagerly, outside tf.function "
            "(it moves Python objects)")
