"""Evaluation on all workers: the compiled step (`EvalStep`) and the loop
over a finite dataset (`evaluate`).

Every example is counted once even when workers hold uneven numbers of
batches: under a strategy the distributed iterator pads and agrees on the
end; with one replica per process (MPI) each process reads its own shard,
and a process whose input has ended runs the same collective with nothing
(`EvalStep.run_empty`) until every process's has.

A preemption signal (or Ctrl-C) is taken between batches: each batch's
all-reduce carries this worker's flag, so all workers stop after the same
batch and `evaluate` raises `Stopped` (the Trainer then saves and leaves as
in training: `trainer/loop.py`).
"""

from typing import Callable, Optional

import keras
import tensorflow as tf

from tfscale.keras import fit_arguments
from tfscale.step.losses import add_others, metric_variables, unreduced
from tfscale.step.feed import (InputPipelineError, ReplicaFeed,
                                  delete_in_background)


def evaluation_input(data, *, global_batch_size: int,
                     per_replica_batch_size: int, batch_size=None, y=None,
                     sample_weight=None):
    """A finite dataset_fn from what `Trainer.evaluate` or `fit`'s
    `validation_data` takes: a dataset_fn (as it is), a tuple
    `(x, y[, sample_weight])`, a `tf.data.Dataset` of global batches, or
    arrays."""
    if fit_arguments.is_dataset_fn(data):
        return data
    if isinstance(data, tuple):
        data, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    return fit_arguments.evaluation_input(
        data, y, sample_weight,
        batch_size=batch_size or global_batch_size,
        per_replica_batch_size=per_replica_batch_size)


class Stopped(Exception):
    """Every worker stopped the evaluation after the same batch: one of
    them was asked to (a preemption signal, Ctrl-C)."""


def evaluate(eval_step: "EvalStep", dataset_fn, *, strategy, collectives,
             steps: Optional[int] = None,
             stop_requested: Optional[Callable[[], bool]] = None) -> dict:
    """Mean loss and metrics of `eval_step`'s model over `dataset_fn`
    (finite), at most `steps` global batches: {"loss": ...}; the metrics
    (reset by the caller) hold theirs.

    Args:
        stop_requested: `fn() -> bool`, this worker's wish to stop, sent
            with each batch's all-reduce.

    Raises:
        InputPipelineError: The input pipeline failed.
        Stopped: A worker asked to stop (`stop_requested`); every worker
            raises it after the same batch.
    """
    if collectives.num_replicas > strategy.num_replicas_in_sync:
        # One replica per process (MPI): this process's shard; the
        # others may have more batches (run_empty matches them).
        iterator = ReplicaFeed(strategy, dataset_fn,
                               num_replicas=collectives.num_replicas,
                               num_workers=collectives.num_workers,
                               worker_index=collectives.worker_index).iterator
    else:
        # The distributed iterator pads and agrees on the end.
        iterator = iter(strategy.distribute_datasets_from_function(
            dataset_fn))
    loss_sum = count = 0.0
    batches = 0
    try:
        while steps is None or batches < steps:
            try:
                optional = iterator.get_next_as_optional()
                has_value = bool(optional.has_value())
            except tf.errors.OpError as e:
                raise InputPipelineError(
                    e.message.strip().splitlines()[0]) from e
            wish = tf.constant(float(bool(stop_requested and
                                          stop_requested())))
            totals = (eval_step.run(optional.get_value(), wish)
                      if has_value else eval_step.run_empty(wish))
            total, n, had_batch, stop = strategy.experimental_local_results(
                totals)[0].numpy()
            if stop:
                raise Stopped()
            if not had_batch:
                break
            loss_sum += float(total)
            count += float(n)
            batches += 1
    finally:
        holder = [iterator]
        del iterator
        delete_in_background(holder)
    return {"loss": loss_sum / max(count, 1.0)}


class EvalStep:
    """Compiled evaluation step: loss and metrics, all-reduced.

    Returns the summed per-example loss, the example count, the number of
    processes that had a batch (so the mean over a whole, possibly uneven,
    evaluation set is exact) and the sum of their wishes to stop.
    `run_empty` is the same collective for a
    process whose input has ended while others' has not (MPI backend).
    """

    def __init__(self, *, model, loss_fn, metrics, strategy, collectives):
        self._model = model
        self._loss_fn = unreduced(loss_fn)
        self._metrics = list(metrics)
        self._metric_variables = metric_variables(metrics, collectives)
        self._strategy = strategy
        self._collectives = collectives
        self.run = tf.function(self._run, autograph=False)
        self.run_empty = tf.function(self._run_empty, autograph=False)

    def _replica_step(self, batch, wish):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        before = [tf.identity(v) for v in self._metric_variables]
        y_pred = self._model(x, training=False)
        losses = self._loss_fn(y, y_pred, sample_weight)
        count = tf.cast(tf.shape(losses)[0], tf.float32)
        for metric in self._metrics:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
        deltas = [v - b for v, b in zip(self._metric_variables, before)]
        return self._reduce(tf.reduce_sum(losses), count, 1.0, wish, deltas)

    def _replica_empty(self, wish):
        deltas = [tf.zeros_like(v) for v in self._metric_variables]
        return self._reduce(0.0, 0.0, 0.0, wish, deltas)

    def _reduce(self, total, count, has_batch, wish, deltas):
        values = [tf.stack([tf.cast(total, tf.float32), count,
                            tf.constant(has_batch), wish])] + deltas
        reduced = self._collectives.all_reduce(values)
        add_others(self._metric_variables, deltas, reduced[1:])
        return reduced[0]

    def _run(self, batch, wish):
        return self._strategy.run(self._replica_step, args=(batch, wish))

    def _run_empty(self, wish):
        return self._strategy.run(self._replica_empty, args=(wish,))
