"""tf.distribute's GPU branch on a machine without a GPU.

TensorFlow 2.21 decides two things by whether every device of a strategy is
a GPU (`_is_gpu_device` in `mirrored_run`, `mirrored_strategy` and
`collective_all_reduce_strategy`):

- `strategy.run(fn)` with `fn` a `tf.function(jit_compile=True)`: on GPUs
  `fn` is traced inside each replica's own graph (where a `merge_call`,
  e.g. Keras's `optimizer.iterations.assign_add`, raises); elsewhere it is
  lifted, `jit(call_for_each_replica(fn))`, one graph where it is legal;
- `_use_merge_call()`: False inside an XLA context on GPUs (a replica
  context's all-reduce then skips the merge_call).

`MirroredStrategy(["/gpu:0"])` takes the GPU branch by its device name
(soft placement runs the ops on the CPU). A `MultiWorkerMirroredStrategy`
on a CPU machine has CPU devices only: `take_gpu_branch()` makes the three
checks answer "GPU" for every device, before the step is traced.

Not reachable on a CPU: NCCL (`CommunicationImplementation.NCCL` needs GPUs)
and the copies between host and device memory; the collectives themselves
run TensorFlow's ring over gRPC either way.
"""

from tensorflow.python.distribute import (collective_all_reduce_strategy,
                                          mirrored_run, mirrored_strategy)

_MODULES = (mirrored_run, mirrored_strategy, collective_all_reduce_strategy)


def take_gpu_branch() -> None:
    """Every device counts as a GPU for tf.distribute from now on."""
    for module in _MODULES:
        module._is_gpu_device = lambda device: True


def merge_call_in_compiled_replica_function_fails(strategy) -> bool:
    """Whether `strategy` takes the GPU branch: a compiled function with a
    `merge_call` handed to `strategy.run` raises there, as on a GPU."""
    import tensorflow as tf

    def merge():
        tf.distribute.get_replica_context().merge_call(lambda _: None)
        return tf.constant(1.0)

    try:
        tf.function(lambda: strategy.run(tf.function(
            merge, jit_compile=True)))()
    except RuntimeError as e:
        return "merge_call" in str(e)
    return False
