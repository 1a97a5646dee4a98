"""The API of `horovod.tensorflow`, on tfscale's MPI backend.

    import tfscale.horovod as hvd      # was: import horovod.tensorflow as hvd
    hvd.init()
    ...
    tfscale-run -np 4 -H server1:2,server2:2 python train.py

Runs on TensorFlow 2.21 with Keras 3 or tf_keras; docs/horovod.md lists
what differs. Importing it changes nothing outside it; `init()` makes Keras
3's `optimizer.variables` also callable, as in Keras 2, for the examples
that broadcast `opt.variables()`
(`tfscale._compat.allow_calling_optimizer_variables`).

    _state.py        the one process-wide state: this rank, its communicators
    ops.py           the collectives (allreduce, allgather, broadcast, join),
                     with their gradients
    protocol.py      how the ranks agree on each collective before it runs
    mpi_buffers.py   MPI on NumPy buffers, once the ranks agree
    host.py          the TensorFlow boundary: every buffer MPI reads or writes
    functions.py     collectives on variables and Python objects
    optimizer.py     DistributedGradientTape and DistributedOptimizer
    compression.py   what travels between the ranks (none, fp16)
    _unsupported.py  Horovod's features it does not offer, each one line
    keras/           `horovod.tensorflow.keras`: its optimizer and callbacks
"""

from tfscale.horovod._state import (cross_rank, cross_size, gloo_built,
                                    gloo_enabled, init, is_homogeneous,
                                    is_initialized, local_rank, local_size,
                                    mpi_built, mpi_enabled,
                                    mpi_threads_supported, nccl_built, rank,
                                    shutdown, size)
from tfscale.horovod._unsupported import (ELASTIC, TIMELINE, Unsupported,
                                          unsupported)
from tfscale.horovod.compression import Compression
from tfscale.horovod.functions import (allgather_object, broadcast_object,
                                       broadcast_variables)
from tfscale.horovod.ops import (Adasum, Average, CollectiveMismatchError,
                                 Max, Min, Product, ProcessSet, Sum, allgather,
                                 allreduce, broadcast, global_process_set,
                                 grouped_allreduce, join)
from tfscale.horovod.optimizer import (DistributedGradientTape,
                                       DistributedOptimizer)


elastic = Unsupported("elastic", ELASTIC)
start_timeline = unsupported("start_timeline", TIMELINE)
stop_timeline = unsupported("stop_timeline", TIMELINE)
alltoall = unsupported(
    "alltoall", "use allgather and keep each rank's part")
reducescatter = unsupported(
    "reducescatter", "use allreduce and keep each rank's part")
grouped_allgather = unsupported(
    "grouped_allgather", "call allgather per tensor")
grouped_reducescatter = unsupported(
    "grouped_reducescatter", "use grouped_allreduce")
add_process_set = unsupported(
    "process sets", "every collective runs on all ranks")
remove_process_set = add_process_set
ccl_built = cuda_built = rocm_built = ddl_built = nccl_built


def broadcast_global_variables(root_rank):
    """TF1's global-variable broadcast; there are none eagerly."""
    raise NotImplementedError(
        "tfscale.horovod: broadcast_global_variables() is TF1-only (no "
        "global collection in TF2): use hvd.broadcast_variables(model."
        "variables, root_rank) or the BroadcastGlobalVariablesCallback")
