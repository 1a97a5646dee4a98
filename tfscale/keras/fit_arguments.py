"""What `model.fit` takes -> the Trainer's `dataset_fn(InputContext)`.

The Trainer's fast path is a `dataset_fn` that builds each worker's pipeline
from its `InputContext` (each worker reads only its files). So that switching
`model.fit(...)` to `trainer.fit(...)` needs no other change, these also work:

  * a `tf.data.Dataset` of *global* batches, as `fit` takes under a
    strategy. It is sharded by data, the policy tf.distribute falls back to:
    every worker runs the whole pipeline, cuts each global batch into one
    slice per worker and keeps its own. Each step therefore trains on exactly
    the global batch one worker would see (N workers match 1 worker), at the
    cost of every worker reading everything;
  * NumPy arrays (or dicts of them) `x`, `y`, `sample_weight` with
    `batch_size` (global), shuffled each epoch with a seed shared by all
    workers.

Training takes only full global batches: a smaller last batch is dropped
(the step's loss is normalised by the global batch size). Evaluation takes
every example.
"""

from typing import Callable, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfscale import _compat

SHUFFLE_SEED = 1234  # the same on every worker: they must agree on order


def is_dataset_fn(x) -> bool:
    return callable(x) and not isinstance(x, tf.data.Dataset)


def training_input(x, y=None, sample_weight=None, *, batch_size: Optional[int],
                   global_batch_size: int, per_replica_batch_size: int,
                   steps_per_epoch: Optional[int], shuffle: bool = True
                   ) -> Tuple[Callable, int]:
    """(dataset_fn of per-replica batches, repeated; steps per epoch). A
    dataset_fn `x` is taken as it is.

    Raises:
        ValueError: The batch size disagrees with the Trainer's global batch,
            the data holds less than one global batch, or the number of steps
            per epoch is needed and cannot be known (always, with a
            dataset_fn).
    """
    if is_dataset_fn(x):
        if steps_per_epoch is None:
            raise ValueError("steps_per_epoch is required with a dataset_fn")
        return x, steps_per_epoch
    if batch_size is not None and batch_size != global_batch_size:
        raise ValueError(
            f"batch_size {batch_size} differs from the Trainer's global batch "
            f"size {global_batch_size} (TrainConfig.global_batch_size)")
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("with a tf.data.Dataset, y and sample_weight "
                             "come from the dataset, not as arguments")
        dataset = x
        _check_batch_dimension(dataset, global_batch_size)
        full = _full_batches(dataset, global_batch_size)
        if steps_per_epoch is None:
            steps_per_epoch = _count_batches(dataset, full, global_batch_size)
        logging.info("tfscale: a dataset of global batches is sharded by "
                     "data: every worker reads it all and keeps its slice of "
                     "each batch (pass a dataset_fn to shard by file)")
    else:
        data = _arrays(x, y, sample_weight)
        examples = _num_examples(data)
        dataset = tf.data.Dataset.from_tensor_slices(data)
        if shuffle:
            dataset = dataset.shuffle(examples, seed=SHUFFLE_SEED,
                                      reshuffle_each_iteration=True)
        full = dataset.batch(global_batch_size, drop_remainder=True)
        if steps_per_epoch is None:
            steps_per_epoch = examples // global_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"the data holds less than one global batch of "
                         f"{global_batch_size} examples")
    full = full.repeat()

    def dataset_fn(context):
        return worker_slices(full, context, per_replica_batch_size,
                             drop_remainder=True)
    return dataset_fn, steps_per_epoch


def evaluation_input(x, y=None, sample_weight=None, *,
                     batch_size: int, per_replica_batch_size: int) -> Callable:
    """dataset_fn of per-replica batches, every example once, no shuffle."""
    if isinstance(x, tf.data.Dataset):
        dataset = x
    else:
        dataset = tf.data.Dataset.from_tensor_slices(
            _arrays(x, y, sample_weight)).batch(batch_size)

    def dataset_fn(context):
        return worker_slices(dataset, context, per_replica_batch_size,
                             drop_remainder=False)
    return dataset_fn


def worker_slices(dataset: tf.data.Dataset, context, per_replica_batch_size,
                  drop_remainder: bool) -> tf.data.Dataset:
    """This worker's slice of each global batch, as per-replica batches
    (local replicas take consecutive ones, as the Trainer's feed expects)."""
    workers = context.num_input_pipelines if context else 1
    index = context.input_pipeline_id if context else 0
    local_replicas = (context.num_replicas_in_sync // workers) if context else 1
    per_worker = per_replica_batch_size * local_replicas
    if workers > 1:
        dataset = dataset.rebatch(per_worker, drop_remainder=drop_remainder)
        dataset = dataset.shard(workers, index)
    dataset = dataset.rebatch(per_replica_batch_size,
                              drop_remainder=drop_remainder)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def _arrays(x, y, sample_weight):
    if x is None:
        raise ValueError("fit needs x: a dataset_fn, a tf.data.Dataset of "
                         "global batches, or arrays")
    parts = [x] + [v for v in (y, sample_weight) if v is not None]
    if sample_weight is not None and y is None:
        raise ValueError("sample_weight needs y")
    return tuple(parts) if len(parts) > 1 else x


def _num_examples(data) -> int:
    sizes = {int(np.shape(v)[0]) for v in tf.nest.flatten(data)}
    if len(sizes) != 1:
        raise ValueError(f"x, y and sample_weight hold different numbers of "
                         f"examples: {sorted(sizes)}")
    return sizes.pop()


def _check_batch_dimension(dataset, global_batch_size):
    shape = tf.nest.flatten(dataset.element_spec)[0].shape
    size = shape[0] if shape.rank else None
    if size is not None and size != global_batch_size:
        raise ValueError(
            f"the dataset's batches hold {size} examples but the Trainer's "
            f"global batch size is {global_batch_size}: batch the dataset "
            "with the global batch size")


def _full_batches(dataset, global_batch_size):
    def full(*element):
        first = tf.nest.flatten(element)[0]
        return tf.equal(tf.shape(first)[0], global_batch_size)
    return dataset.filter(full)


def _count_batches(dataset, full, global_batch_size) -> int:
    """Full global batches in one pass over `dataset`."""
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError("the dataset repeats forever: pass steps_per_epoch")
    shape = tf.nest.flatten(dataset.element_spec)[0].shape
    if cardinality >= 0 and shape.rank and shape[0] == global_batch_size:
        return cardinality  # batched with drop_remainder: all full
    # Unknown length or a possibly smaller last batch: count once.
    return int(full.reduce(tf.constant(0, tf.int64),
                           lambda count, _: count + 1))


def compiled_parts(model) -> tuple:
    """(optimizer, loss, metrics) of `model.compile`, for
    `Trainer.from_compiled`.

    Raises:
        ValueError: The model is not compiled, or its loss is a list or
            dict (one loss per output is not supported).
    """
    if getattr(model, "optimizer", None) is None or not getattr(
            model, "compiled", False):
        raise ValueError("compile the model first (optimizer, loss, "
                         "metrics), or use the Trainer constructor")
    loss = model.loss
    if isinstance(loss, (list, tuple, dict)) or loss is None:
        raise ValueError(f"the compiled loss must be one loss, got "
                         f"{loss!r}; pass loss_fn to the constructor")
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    return model.optimizer, loss, _compat.compiled_metrics(model)
