"""The API of `horovod.tensorflow.keras`, on tfscale's MPI backend.

    import tfscale.horovod.keras as hvd   # was: import horovod.tensorflow.keras as hvd

Works with the Keras that `tf.keras` is: Keras 3 (TensorFlow 2.21's
default) or tf_keras (`TF_USE_LEGACY_KERAS=1`). Keras 3's `compile()`
rejects `experimental_run_tf_function=False`: drop that argument.
"""

import tensorflow as tf

from tfscale.horovod import (Adasum, Average, Compression, Max, Min, Product,
                             ProcessSet, Sum, allgather_object,
                             broadcast_object, cross_rank, cross_size,
                             elastic, global_process_set, gloo_built,
                             gloo_enabled, init, is_homogeneous,
                             is_initialized, join, local_rank, local_size,
                             mpi_built, mpi_enabled, mpi_threads_supported,
                             nccl_built, rank, shutdown, size,
                             start_timeline, stop_timeline)
from tfscale.horovod import ops as _ops
from tfscale.horovod.keras import callbacks
from tfscale.horovod.optimizer import DistributedOptimizer as _distributed


def DistributedOptimizer(optimizer, name=None, device_dense="",
                         device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """`optimizer` made to average its gradients over all ranks (see
    `tfscale.horovod.DistributedOptimizer`); use it in `model.compile`."""
    return _distributed(
        optimizer, name=name, compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups, groups=groups, process_set=process_set,
        scale_local_gradients=scale_local_gradients)


def allreduce(value, name=None, average=None, prescale_factor=1.0,
              postscale_factor=1.0, op=None, compression=Compression.none,
              process_set=global_process_set):
    """The reduction of `value` (array or tensor) over all ranks, as a
    tensor."""
    return _ops.allreduce(tf.convert_to_tensor(value), name=name,
                          average=average, op=op,
                          prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor,
                          compression=compression, process_set=process_set)


def allgather(value, name=None, process_set=global_process_set):
    """Every rank's `value` concatenated on the first dimension."""
    return _ops.allgather(tf.convert_to_tensor(value), name=name,
                          process_set=process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Rank `root_rank`'s `value` on every rank."""
    return _ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name,
                          process_set=process_set)


def broadcast_global_variables(root_rank):
    """TF1 only in Horovod; use the callback in TF2."""
    raise NotImplementedError(
        "tfscale.horovod.keras: broadcast_global_variables() is TF1-only: "
        "pass hvd.callbacks.BroadcastGlobalVariablesCallback(0) to fit()")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """`tf.keras.models.load_model(filepath)` with its optimizer wrapped in
    `DistributedOptimizer` (Keras 3 loads `.keras` and `.h5` files)."""
    objects = dict(custom_objects or {})
    for optimizer_class in custom_optimizers or ():
        objects[optimizer_class.__name__] = optimizer_class
    model = tf.keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model
