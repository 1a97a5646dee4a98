"""tensorflow-datasets sources, sharded per worker, batched and prefetched.

Works offline on datasets already prepared in `data_dir` (it never
downloads). Each input pipeline reads a disjoint part: tfds's own file
sharding (`ReadConfig(input_context=...)`) when the split has at least as
many files as pipelines, else an even record split (`tfds.even_splits`).
"""

import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from input_pipelines import materials  # noqa: F401  (registers stress_strain)
from input_pipelines.extras import require
from input_pipelines.tfrecord import dataset_options

tfds = require("tensorflow_datasets", "tfds")


@dataclasses.dataclass(frozen=True)
class TfdsConfig:
    """A tfds dataset to read.

    Attributes:
        name: Registered name, e.g. "stress_strain/small" or "mnist".
        split: Split to read, e.g. "train" or "test[:10%]".
        data_dir: Where the prepared dataset lives (tfds's default if None).
        training: Shuffle and repeat (True) or read every example once.
        shuffle_buffer_size: Examples in the shuffle buffer.
        seed: Seed for file and example shuffles.
        as_supervised: Yield (input, target) pairs.
    """

    name: str
    split: str = "train"
    data_dir: Optional[str] = None
    training: bool = True
    shuffle_buffer_size: int = 10_000
    seed: Optional[int] = None
    as_supervised: bool = True


def make_dataset_fn(config: TfdsConfig, per_replica_batch_size: int) -> Callable:
    """`fn(InputContext) -> dataset` of batches of `per_replica_batch_size`."""
    builder = tfds.builder(config.name, data_dir=config.data_dir)
    try:
        # Lazy (reads metadata only); tfds.testing.mock_data patches it.
        builder.as_dataset(split=config.split)
    except (AssertionError, FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(
            f"tfds dataset {config.name} split {config.split!r} is not "
            f"prepared in {builder.data_dir} (tfscale never downloads): "
            f"{str(e).splitlines()[0]}") from None

    def dataset_fn(input_context: Optional[tf.distribute.InputContext] = None):
        num = input_context.num_input_pipelines if input_context else 1
        index = input_context.input_pipeline_id if input_context else 0
        split, read_context = config.split, None
        if num > 1:
            if builder.info.splits[config.split].num_shards >= num:
                read_context = input_context
            else:
                split = tfds.even_splits(config.split, n=num)[index]
        read_config = tfds.ReadConfig(input_context=read_context,
                                      shuffle_seed=config.seed)
        ds = builder.as_dataset(split=split, shuffle_files=config.training,
                                as_supervised=config.as_supervised,
                                read_config=read_config)
        if config.training:
            ds = ds.shuffle(config.shuffle_buffer_size, seed=config.seed).repeat()
        ds = ds.batch(per_replica_batch_size, drop_remainder=config.training)
        deterministic = config.seed is not None or not config.training
        return ds.prefetch(tf.data.AUTOTUNE).with_options(
            dataset_options(deterministic))
    return dataset_fn
