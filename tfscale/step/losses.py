"""What the training and evaluation steps share: the loss per example, and
the metric states summed over processes.

Both steps divide by a batch themselves (the global batch in training, the
example count in evaluation), so the loss comes per example (`unreduced`).
Under the MPI backend each process runs its own single-replica strategy, so
its metric variables hold its own updates only; the steps sum the updates
in their all-reduce (`metric_variables`, `add_others`).
"""

import copy
from typing import Callable

import keras
import tensorflow as tf


def unreduced(loss_fn) -> Callable:
    """`loss_fn` as `fn(y_true, y_pred, sample_weight) -> [batch]` float32.

    A `keras.losses.Loss` goes through its own `__call__` (its dtype
    conversion of y_true / y_pred, masks and sample weights) with the
    reduction switched off, on a copy: the step divides by the global batch
    itself (Keras's reduction would also divide by the number of replicas).
    Any other callable must return one value per example (or per token:
    extra axes are averaged); sample weights multiply it.
    """
    if isinstance(loss_fn, keras.losses.Loss):
        per_example = copy.copy(loss_fn)
        per_example.reduction = None

        def call(y_true, y_pred, sample_weight):
            return _per_example(per_example(y_true, y_pred,
                                            sample_weight=sample_weight))
        return call

    def call(y_true, y_pred, sample_weight):
        values = _per_example(loss_fn(y_true, y_pred))
        if sample_weight is not None:
            values = values * tf.cast(sample_weight, values.dtype)
        return values
    return call


def _per_example(values):
    values = tf.cast(values, tf.float32)
    # Per-token losses (more axes than the batch) are averaged per example.
    if values.shape.rank and values.shape.rank > 1:
        values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
    return values


def metric_variables(metrics, collectives) -> list:
    """The metric states the step must sum over processes (MPI backend; a
    strategy's own metric variables aggregate on read)."""
    if not collectives.reduces_metrics:
        return []
    return [v for m in metrics for v in m.variables]


def add_others(variables, local_deltas, summed_deltas) -> None:
    """Adds the other processes' metric updates: each process then holds the
    global states (every metric state of Keras's metrics is a sum)."""
    for v, mine, total in zip(variables, local_deltas, summed_deltas):
        v.assign_add(total - mine)
