"""Dataset functions: what the Trainer calls to build each worker's input
pipelines (`fn(InputContext) -> tf.data.Dataset`).

A training set in the global order gets a `PositionedDatasetFn`: the
Trainer starts it at the position its checkpoint holds (`at`), keeps the
order's identity in the checkpoint (`order`) and, when a resumed run's
records or seed changed, asks where the new order starts (`reorder`).
Training on a tf.data service gets the service's dataset function; other
sets a plain `DatasetFn`.
"""

import dataclasses
import functools
from typing import Callable, Optional, Tuple

import tensorflow as tf

from input_pipelines import service as service_lib
from input_pipelines.record_files import expand_files
from input_pipelines.record_order import identity as order_identity
from input_pipelines.record_order import index as record_index
from input_pipelines.tfrecord import (DEFAULT_ORDER_SEED, TFRecordConfig,
                                      partial_shards,
                                      uses_global_order)


class DatasetFn:
    """`fn(InputContext) -> tf.data.Dataset` of per-replica batches.

    Args:
        build: `fn(input_context, start_position) -> tf.data.Dataset`.
        start_position: Where the pipelines start (global order).
    """

    def __init__(self, build: Callable, start_position: int = 0):
        self._build = build
        self.start_position = int(start_position)

    def __call__(self, input_context=None) -> tf.data.Dataset:
        return self._build(input_context, self.start_position)


class PositionedDatasetFn(DatasetFn):
    """A `DatasetFn` in the global order, with `at(position)`: the same
    pipelines from a global record position on. The Trainer calls it with
    the position its checkpoint holds, so a resumed run, on any worker
    count, continues the uninterrupted run's order (`tfscale.trainer.loop`).

    `order()` names what a position means (the record set and the seed,
    `record_order/identity.py`); the Trainer keeps it in the checkpoint and
    asks `reorder` where to start when a resumed run's records or seed
    differ from the checkpoint's.
    """

    def __init__(self, build: Callable, config: "TFRecordConfig",
                 start_position: int = 0, order: Optional[str] = None):
        super().__init__(build, start_position)
        self._config = config
        self._order = order

    def at(self, position: int) -> "PositionedDatasetFn":
        return PositionedDatasetFn(self._build, self._config, position,
                                   self._order)

    def order(self) -> str:
        """The identity of this order (JSON): files, their record counts
        and content fingerprints, the seed."""
        if self._order is None:
            files = expand_files(self._config.input_files,
                                 partial_shards(self._config))
            offsets = record_index.load(files)
            seed = (DEFAULT_ORDER_SEED if self._config.seed is None
                    else self._config.seed)
            self._order = order_identity.describe(
                files, [len(o) - 1 for o in offsets], seed,
                record_index.fingerprints(files, offsets))
        return self._order

    def reorder(self, saved: str, position: int,
                global_batch_size: int) -> Tuple[int, Optional[str]]:
        """(the position to start at, a line saying why it moved, or None)
        for a run resumed at `position` of the order `saved` names."""
        changed = order_identity.changes(saved, self.order())
        if not changed:
            return position, None
        start, epoch = order_identity.restart_position(
            saved, position, self.order(), global_batch_size)
        return start, (
            f"differs from the checkpoint's ({'; '.join(changed)}): "
            f"its position {position} belongs to another order, so the new "
            f"order starts at its epoch {epoch}, global record {start}")


def make_dataset_fn(config: TFRecordConfig, build: Callable) -> DatasetFn:
    """`build(config, input_context, start_position)` as a dataset_fn:
    positioned in the global order, run by the tf.data service when the
    config names one. Fails now, on the host, naming a pattern that matches
    nothing, rather than inside tf.data."""
    expand_files(config.input_files, partial_shards(config))
    if config.training and config.service is not None:
        return service_lib.ServiceDatasetFn(
            lambda seed: build(_service_records(config, seed), None, 0),
            config.service)
    if uses_global_order(config):
        return PositionedDatasetFn(functools.partial(build, config), config)
    return DatasetFn(functools.partial(build, config))


def _service_records(config: TFRecordConfig, seed) -> TFRecordConfig:
    """The config a service worker's pipeline is built from: every trainer
    must register the same graph, so a missing seed becomes a fixed one;
    `seed` (a tensor) overrides it ("parallel_epochs")."""
    if seed is None:
        seed = DEFAULT_ORDER_SEED if config.seed is None else config.seed
    return dataclasses.replace(config, seed=seed)
