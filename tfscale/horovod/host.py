"""The TensorFlow boundary of tfscale.horovod: every buffer MPI reads or
writes is host memory, made as such.

Eagerly, the input's host view (its own buffer when it lives on the host, a
copy from a GPU otherwise) and a new tensor pinned to the host that MPI
fills in place (`_compat.new_host_tensor`); inside a `tf.function`,
`tf.numpy_function`s pinned to the host, which TensorFlow's automatic
control dependencies keep in program order, so all ranks issue them in the
same order. Results go back to the device the input was on, as Horovod's
do. (An output made on a GPU and filled through its host copy would come
back uninitialised.)
"""

import numpy as np
import tensorflow as tf

from tfscale import _compat

def encode_shapes(tensors) -> tf.Tensor:
    parts = []
    for t in tensors:
        shape = tf.shape(t, out_type=tf.int64)
        parts += [tf.reshape(tf.size(shape, out_type=tf.int64), [1]), shape]
    return tf.concat(parts, 0)


HOST = "/cpu:0"


def host_view(tensor: tf.Tensor) -> np.ndarray:
    """An eager tensor's values in host memory, for MPI to read: the
    tensor's own buffer when it is on the host, a copy from a device."""
    return np.asarray(tensor)


def placed_like(result, original):
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


def host_numpy_function(fn, inputs, like, name):
    """`fn(*inputs, out)` in a `tf.numpy_function` on the host (graph
    mode), `out` an uninitialised host tensor shaped as `like` for MPI to
    write and `fn` to return: it becomes the result without a copy (a new
    NumPy array would be copied). `Empty` is never folded or shared, so
    every call gets its own."""
    with tf.device(HOST):
        out = tf.raw_ops.Empty(shape=tf.shape(like), dtype=like.dtype)
        return tf.numpy_function(fn, [*inputs, out], like.dtype,
                                 stateful=True, name=name)


def refuse_xla(name: str) -> None:
    if _compat.in_xla_context():
        raise ValueError(
            f"tfscale.horovod: {name!r} cannot run inside an XLA-compiled "
            "function (jit_compile=True): MPI is called from the host. "
            "Compile the Keras model with jit_compile=False, or use "
            "tfscale's Trainer, whose --xla compiles the step and reduces "
            "outside it")
