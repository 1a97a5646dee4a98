"""Per-replica step inputs from this worker's `tf.data` pipeline.

`strategy.distribute_datasets_from_function` hides its per-worker iterator,
and that iterator cannot be checkpointed. The Trainer instead builds this
worker's dataset itself (from the same `InputContext` tf.distribute would
pass), iterates it with an ordinary `tf.data` iterator, which
`tf.train.Checkpoint` saves and restores (file offsets, shuffle buffers,
prefetched batches: resuming costs the same at step 10 and step 500,000),
and hands each local replica its batch with
`experimental_distribute_values_from_function`. Measured on 2 logical CPUs,
this costs no more per step than the distributed iterator.

Local replicas take consecutive elements, as with
`distribute_datasets_from_function`. Batches are not prefetched to GPU
memory: the copy happens at the start of the step.

Finished iterators are deleted on a background thread
(`delete_in_background`): in TF 2.21, deleting a `tf.data` iterator with
autotune on sometimes blocks the deleting thread for up to about a minute
(`python -m benchmarks.pipelines.iterator_deletion`: 2 workers under CPU load, 5 of 6
runs blocked about 40 s in `DeleteIterator`; with autotune off, 0 of 6). A
worker blocked there holds every other worker in the next collective; off
the main thread it holds no one. The thread is not a daemon: Python waits
for it at exit (a daemon thread still inside TensorFlow at exit aborted the
process in 2 of 11 runs). So that a worker does not sit there after its last
line, the entry points leave with `os._exit` once every file is flushed
(`tfscale.cli.leave`; `python -m benchmarks.preemption.exit_time`).
"""

import re
import threading

import tensorflow as tf

from tfscale.cluster import fail_fast


def delete_in_background(holder: list) -> threading.Thread:
    """Drops the objects in `holder`, their only references, on another
    thread, so a slow `tf.data` iterator deletion never blocks the caller;
    returns the thread."""
    thread = threading.Thread(target=holder.clear,
                              name="tfscale-delete-iterator", daemon=False)
    thread.start()
    return thread


class InputPipelineError(Exception):
    """The input pipeline failed (a corrupt record, a parse or check error),
    as opposed to the model or the step: callers can diagnose the records
    without mistaking a model bug for bad data. `__cause__` holds
    TensorFlow's error."""


class ReplicaFeed:
    """This worker's dataset, served as per-replica micro-batches.

    Args:
        strategy: The strategy.
        num_replicas: Replicas over all workers (more than the strategy's
            when each process runs its own single-replica strategy, MPI).
        dataset_fn: `fn(tf.distribute.InputContext) -> tf.data.Dataset` of
            per-replica batches.
        num_workers: Number of workers (input pipelines).
        worker_index: This worker's index.
    """

    def __init__(self, strategy, dataset_fn, *, num_replicas: int,
                 num_workers: int, worker_index: int):
        replicas = num_replicas
        self._strategy = strategy
        self._local_replicas = replicas // num_workers
        # Replica ids in `strategy` are global (MultiWorkerMirroredStrategy)
        # or local (a strategy of this process only).
        spans_workers = strategy.num_replicas_in_sync > self._local_replicas
        self._first_replica = (worker_index * self._local_replicas
                               if spans_workers else 0)
        context = tf.distribute.InputContext(
            num_input_pipelines=num_workers, input_pipeline_id=worker_index,
            num_replicas_in_sync=replicas)
        with tf.device("/cpu:0"):
            self.iterator = iter(dataset_fn(context))

    def close(self, wait_seconds: float = 0.0) -> None:
        """Deletes the iterator (and its threads) in the background; call it
        once nothing else (a checkpoint) refers to the iterator. With
        `wait_seconds`, waits that long at most for the deletion (a process
        about to exit: it would wait for it then, alone)."""
        holder, self.iterator = [self.iterator], None
        thread = delete_in_background(holder)
        if wait_seconds:
            thread.join(timeout=wait_seconds)

    def take(self, iterator, num_micro_batches: int) -> tuple:
        """The next step's micro-batches from `iterator` (this feed's), each
        a per-replica value. On the host, or inside a compiled step (the
        iterator then passed in as an argument, and an input error surfaces
        from the call: `is_input_error`)."""
        return tuple(self._micro_batch(iterator)
                     for _ in range(num_micro_batches))

    def _micro_batch(self, iterator):
        try:
            elements = [next(iterator) for _ in range(self._local_replicas)]
        except tf.errors.OpError as e:
            raise input_error(e) from e
        first = self._first_replica
        return self._strategy.experimental_distribute_values_from_function(
            lambda context: elements[context.replica_id_in_sync_group - first])


class BatchSizeError(ValueError):
    """The input's batches are not the per-replica batch the Trainer's
    loss scaling, throughput and input position count."""


# What marks the batch check's assertion in TensorFlow's error message.
_BATCH_MARK = "tfscale batch check: dataset_fn yields batches of"


class BatchCheck:
    """The per-replica batch the step takes, checked against the batches
    the input yields.

    Every micro-batch's loss is summed over its examples and divided by the
    global batch (`step/replica.py`): batches of the global size (Keras's
    habit) would train N x k times too hard, silently. A batch dimension
    known when the step is traced is checked then, in Python; an unknown one
    (`Dataset.batch` without `drop_remainder`) in every step of a call, by
    a compare of the batch dimension where the shape lives (the host: no
    read of the device).

    Args:
        per_replica_batch_size: What each replica takes per micro-batch.
        words: The global batch's arithmetic, for the error.
    """

    def __init__(self, per_replica_batch_size: int, words: str):
        self.expected = per_replica_batch_size
        self.words = words

    @classmethod
    def of(cls, config, replicas: int) -> "BatchCheck":
        """The check of a `TrainConfig`'s batch over `replicas`."""
        k = config.num_accumulation_steps
        per_replica = config.global_batch_size // (replicas * k)
        return cls(per_replica, (
            f"global batch {config.global_batch_size} = {per_replica} per "
            f"replica x {replicas} replica(s) x {k} accumulation step(s)"))

    def message(self, yielded) -> str:
        return (f"dataset_fn yields batches of {yielded} examples; the "
                f"Trainer takes {self.expected} per replica per micro-batch "
                f"({self.words}): batch the dataset with "
                "trainer.per_replica_batch_size")

    def static(self, element_spec) -> None:
        """Raises `BatchSizeError` when the input's batch dimension is
        known and wrong (on the host, before a step runs)."""
        spec = tf.nest.flatten(element_spec, expand_composites=True)[0]
        size = spec.shape[0] if spec.shape.rank else None
        if size is not None and size != self.expected:
            raise BatchSizeError(self.message(size))

    def __call__(self, strategy, micro_batches) -> list:
        """The device assertions for the batch dimensions not known when
        the step is traced (eager batches: checked at once)."""
        checks = []
        for batch in micro_batches:
            for leaf in strategy.experimental_local_results(
                    tf.nest.flatten(batch)[0]):
                if tf.executing_eagerly():
                    if int(leaf.shape[0]) != self.expected:
                        raise BatchSizeError(self.message(leaf.shape[0]))
                    continue
                if leaf.shape.rank and leaf.shape[0] is not None:
                    continue  # checked on the host (`static`)
                actual = tf.shape(leaf)[0]
                checks.append(tf.debugging.Assert(
                    tf.equal(actual, self.expected),
                    [_BATCH_MARK, actual]))
        return checks

    def error(self, error: tf.errors.OpError):
        """The `BatchSizeError` a failed device check raised, or None."""
        found = re.search(re.escape(_BATCH_MARK) + r"\]\s*\[(\d+)\]",
                          error.message or "")
        return BatchSizeError(self.message(found.group(1))) if found else None


def is_input_error(error: tf.errors.OpError) -> bool:
    """Whether an error raised by a compiled step came from reading its
    input (the iterator's get-next op), not from the model or a collective."""
    return (isinstance(error, tf.errors.OutOfRangeError)
            or "IteratorGetNext" in (error.message or ""))


def input_error(error: tf.errors.OpError) -> InputPipelineError:
    """An `InputPipelineError` with the line of TensorFlow's message that
    says what went wrong (a compiled call's error wraps it in lines about
    graphs, nodes and root errors: `fail_fast.cause`)."""
    return InputPipelineError(fail_fast.cause(error.message))
