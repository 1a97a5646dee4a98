"""The TFRecord pipeline builder, for any feature spec.

    files -> shard per input pipeline -> shuffle files -> interleave
    -> [shard by record] -> [cache] -> shuffle blocks of records -> repeat
    -> chunks of records -> one vectorized parse per chunk -> [transform]
    -> rebatch to the batch size -> prefetch

Batch first, then parse the whole batch with one `tf.io.parse_example`: the
fused map-and-batch of today, about 6x faster on 2 cores than parsing each
example (DESIGN.md fact 5). `parse_example` is cheaper per record on bigger
batches, so records are parsed in chunks of `parse_chunk_size` (2,048-4,096: +15-30%
over parsing batches of 256 here) and the parsed tensors are then sliced into
batches with `rebatch`. Nothing runs per record on the hot path: no
per-record map, no file-name tagging (it cost 15-25% here). When a read or
parse fails, `find_bad_record` scans the files on the host and names the file
and the feature.

Defaults were measured on 2 cores (benchmarks/README.md): one sequential
interleave over 2 files with blocks of 128 records keeps one core reading
while the other parses; tf.data's AUTOTUNE interleave was 9x slower there.
Records are shuffled in blocks of `block_length` consecutive records, so the
files should already be shuffled inside (Google's and our record writers
shuffle instances); lower `block_length` for files sorted by label. On hosts
with many cores, raise `num_parallel_reads` and `cycle_length`.

Images are the other shape (`make_example_dataset`): decoding a JPEG costs
milliseconds, so each record is mapped on its own, in parallel, then the
results are batched (what tf.data fuses into map-and-batch); records are
shuffled one by one, and each carries its position in the stream, from
which augmentations draw stateless seeds (see images.py).

Training reads records in one of two orders (`TFRecordConfig.order`):

  * "global" (default): one seeded permutation of all records per epoch,
    the same whatever the number of workers (`record_order/`). Global batch
    s holds positions [s*B, (s+1)*B) of it; each worker reads only its part
    of each one, by record number, through the files' offset indexes
    (`record_order/index.py`, built by the writers or on first use). A
    pipeline can start at any global position (`DatasetFn.at`): a resume,
    on any worker count, continues the same order in O(1).
  * "sharded": files dealt out per worker, interleaved, a shuffle buffer per
    worker (the order depends on the worker count). For compressed records
    or files not on a local file system (no random access), and the
    fallback for them. Sharding by file when there are at least as many
    files as input pipelines (each worker opens only its files), by record
    otherwise (every worker reads everything and keeps every N-th record,
    with a deterministic interleave so that the N slices are disjoint and
    complete). Evaluation always reads this way (no shuffle, every record
    once across workers).
"""

import dataclasses
import functools
import os
import re
from typing import Callable, Mapping, Optional, Sequence, Tuple, Union

import tensorflow as tf
from absl import logging

from input_pipelines import service as service_lib
from input_pipelines.record_order import identity as order_identity
from input_pipelines.record_order import index as record_index
from input_pipelines.record_order import partition
from input_pipelines.record_order.reader import RecordReader, split_offsets

AUTOTUNE = tf.data.AUTOTUNE
ORDERS = ("global", "sharded")
# Seed of the global order when the config gives none: every worker must
# compute the same permutation.
DEFAULT_ORDER_SEED = 0
# Records per read in the image pipeline (JPEGs: ~100 KB each).
EXAMPLE_READ_RECORDS = 64


class InputError(ValueError):
    """Input files are missing, empty or malformed; the message names them."""


@dataclasses.dataclass(frozen=True)
class TFRecordConfig:
    """How to read a set of TFRecord files.

    Attributes:
        input_files: Glob patterns, comma-separated lists of them, or a
            sequence of either.
        training: True: shuffle and repeat forever. False (evaluation): no
            shuffle, no repeat, every record seen once across all workers.
        shuffle_buffer_size: Records in the shuffle buffer (training); they
            are shuffled in blocks of `block_length` consecutive records.
        cycle_length: Files read at once per pipeline.
        block_length: Consecutive records taken from each file.
        num_parallel_reads: Parallel interleave calls; None reads in the
            pipeline's own thread (fastest on 2 cores), AUTOTUNE lets TF pick.
        deterministic: Reproducible order (with `seed`); a little slower.
        seed: Seed of the file and record shuffles.
        cache: None, "memory", or a file path prefix to cache records in.
        skip_corrupt: Skip unreadable records and unparsable chunks, with a
            warning for each, instead of failing.
        parse_chunk_size: Records per `parse_example` call, rounded up to a
            multiple of the batch size.
        compression_type: None, "GZIP" or "ZLIB".
        threadpool_size: tf.data private threadpool size (None: default).
        autotune_ram_budget: Bytes tf.data's autotuner may use (None: default).
        order: Training order: "global" (the same records in every global
            batch on any worker count; exact resume on any count) or
            "sharded" (files dealt out per worker). See the module doc.
        service: Run the training pipeline on a tf.data service
            (`service.py`; order "sharded" without per-worker shards: the
            service deals out the files).
    """

    input_files: Union[str, Sequence[str]]
    training: bool = True
    shuffle_buffer_size: int = 10_000
    cycle_length: int = 2
    block_length: int = 128
    num_parallel_reads: Optional[int] = None
    deterministic: bool = False
    seed: Optional[int] = None
    cache: Optional[str] = None
    skip_corrupt: bool = False
    parse_chunk_size: int = 4096
    compression_type: Optional[str] = None
    threadpool_size: Optional[int] = None
    autotune_ram_budget: Optional[int] = None
    order: str = "global"
    service: Optional[service_lib.ServiceConfig] = None

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got "
                             f"{self.order!r}")
        if self.service is not None and self.order == "global":
            raise ValueError(
                "order 'global' reads records by number on each trainer, "
                "which a tf.data service cannot: use order 'sharded' with "
                "data_service")
        for name in ("cycle_length", "block_length", "parse_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shuffle_buffer_size < 0:
            raise ValueError("shuffle_buffer_size must be >= 0, got "
                             f"{self.shuffle_buffer_size}")
        if self.num_parallel_reads not in (None, AUTOTUNE) and (
                self.num_parallel_reads < 1):
            raise ValueError("num_parallel_reads must be None, AUTOTUNE or "
                             f">= 1, got {self.num_parallel_reads}")
        if self.compression_type not in (None, "", "GZIP", "ZLIB"):
            raise ValueError("compression_type must be None, 'GZIP' or "
                             f"'ZLIB', got {self.compression_type!r}")


def expand_files(input_files: Union[str, Sequence[str]]) -> list:
    """Globs and comma lists -> sorted unique file names.

    Raises:
        InputError: A pattern matches no file or a directory (naming it), or
            no pattern was given.
    """
    if isinstance(input_files, str):
        input_files = [input_files]
    patterns = [p.strip() for item in input_files for p in item.split(",")
                if p.strip()]
    if not patterns:
        raise InputError("no input files given")
    files = []
    for pattern in patterns:
        matched = tf.io.gfile.glob(pattern)
        if not matched:
            raise InputError(f"no files match input pattern {pattern!r}")
        # Hidden names are never records: the record indexes
        # (.tfscale-index/) and half-written shards live there.
        matched = [name for name in matched
                   if not os.path.basename(name.rstrip("/")).startswith(".")]
        if not matched:
            raise InputError(f"no files match input pattern {pattern!r}")
        for name in matched:
            if tf.io.gfile.isdir(name):
                raise InputError(
                    f"{name} is a directory, not a record file; name the "
                    f"files, e.g. '{name.rstrip('/')}/*.tfrecord'")
        files.extend(matched)
    return sorted(set(files))


def shard_files(files: Sequence[str], num_pipelines: int, pipeline_id: int):
    """(this pipeline's files, by_file) for one of `num_pipelines` pipelines.

    By file (every pipeline a disjoint subset) when files >= pipelines; else
    all files, to be sharded by record.
    """
    if len(files) >= num_pipelines:
        return list(files[pipeline_id::num_pipelines]), True
    return list(files), False


def make_parse_fn(feature_spec: Mapping[str, tf.io.FixedLenFeature],
                  transform: Optional[Callable] = None):
    """A batched parse: serialized records [batch] -> (transformed) dict."""
    def parse(serialized):
        features = tf.io.parse_example(serialized, feature_spec)
        return transform(features) if transform else features
    return parse


def make_dataset(config: TFRecordConfig, batch_size: int, parse_fn: Callable,
                 input_context: Optional[tf.distribute.InputContext] = None,
                 start_position: int = 0) -> tf.data.Dataset:
    """Builds the pipeline of one input pipeline (one worker): records are
    batched, then parsed a chunk at a time (cheap per-record work: BERT).

    Args:
        config: What to read and how.
        batch_size: Examples per batch (the per-replica batch under
            `distribute_datasets_from_function`).
        parse_fn: `fn(serialized batch) -> features`, from `make_parse_fn`.
        input_context: This pipeline's place among all of them; None: one.
        start_position: Global order: the first global record position to
            read (a resumed run's); ignored by the sharded order.

    Returns:
        A `tf.data.Dataset` of parsed batches.

    Raises:
        InputError: The input files are missing or do not index.
    """
    chunk = batch_size * max(1, -(-config.parse_chunk_size // batch_size))
    if uses_global_order(config):
        ds = _global_chunks(config, input_context, batch_size,
                            start_position, chunk)
        deterministic = True  # the order is the point
        ds = ds.map(lambda positions, records: records)
    else:
        ds, deterministic = _records(config, input_context)
        if config.training:
            # Shuffle blocks of `block_length` records (what the interleave
            # hands out from one file anyway), then rebatch: a record-level
            # shuffle costs about 30% of the throughput on 2 cores, this
            # about nothing.
            ds = ds.batch(config.block_length)
            if config.shuffle_buffer_size > 0:
                ds = ds.shuffle(
                    max(1, config.shuffle_buffer_size // config.block_length),
                    seed=config.seed, reshuffle_each_iteration=True)
            ds = ds.repeat().rebatch(chunk, drop_remainder=True)
        else:
            ds = ds.batch(chunk)
    ds = ds.map(parse_fn, num_parallel_calls=AUTOTUNE,
                deterministic=deterministic)
    if config.skip_corrupt:
        ds = ds.ignore_errors(log_warning=True)
    ds = ds.rebatch(batch_size, drop_remainder=config.training)
    ds = ds.prefetch(AUTOTUNE)
    return ds.with_options(dataset_options(
        deterministic, config.threadpool_size, config.autotune_ram_budget))


def make_example_dataset(config: TFRecordConfig, batch_size: int,
                         example_fn: Callable,
                         input_context: Optional[tf.distribute.InputContext]
                         = None, num_parallel_calls: Optional[int] = AUTOTUNE,
                         on_skipped: Optional[Callable] = None,
                         start_position: int = 0) -> tf.data.Dataset:
    """Builds one input pipeline whose per-record work is heavy (images):
    records are shuffled, then each is mapped in parallel, then batched.

    `example_fn(index, serialized)` gets the record's position: in the
    global order, its global position (the same record at the same position
    on any worker count); in the sharded order, its position in this
    pipeline's output stream (0, 1, 2, ... across epochs). Random
    augmentations draw stateless seeds from it: every epoch differs, a seed
    fixes them all, and a resumed pipeline continues exactly.

    Args:
        config: What to read and how.
        batch_size: Examples per batch.
        example_fn: `fn(index, serialized record) -> example`.
        input_context: This pipeline's place among all of them; None: one.
        num_parallel_calls: Parallel `example_fn` calls (None: sequential).
        on_skipped: With `config.skip_corrupt`, `fn(count)` -> an op run
            each time a record is skipped, given the running count (e.g. a
            `tf.print`). Records are then mapped in order (to count).
        start_position: As in `make_dataset`.

    Returns:
        A `tf.data.Dataset` of batches.

    Raises:
        InputError: The input files are missing or do not index.
    """
    counting = config.skip_corrupt and on_skipped is not None
    if uses_global_order(config):
        ds = _global_chunks(config, input_context, batch_size, start_position,
                            EXAMPLE_READ_RECORDS).unbatch()
        deterministic = True
        counting = False  # positions are not consecutive: no gaps to count
    else:
        ds, deterministic = _records(config, input_context)
        if config.training:
            if config.shuffle_buffer_size > 0:
                ds = ds.shuffle(config.shuffle_buffer_size, seed=config.seed,
                                reshuffle_each_iteration=True)
            ds = ds.repeat()
        ds = ds.enumerate()
    ds = ds.map(lambda index, record: (index, example_fn(index, record)),
                num_parallel_calls=num_parallel_calls,
                deterministic=deterministic or counting)
    if config.skip_corrupt:
        ds = ds.ignore_errors(log_warning=True)
        if counting:
            ds = ds.scan((tf.constant(-1, tf.int64),
                          tf.constant(0, tf.int64)), _count_gaps(on_skipped))
    ds = ds.map(lambda index, example: example)
    ds = ds.batch(batch_size, drop_remainder=config.training,
                  num_parallel_calls=AUTOTUNE if num_parallel_calls else None,
                  deterministic=deterministic)
    ds = ds.prefetch(AUTOTUNE)
    return ds.with_options(dataset_options(
        deterministic, config.threadpool_size, config.autotune_ram_budget))


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
    count, continues the uninterrupted run's order (`tfscale.trainer`).

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
        """The identity of this order (JSON): files, record counts, seed."""
        if self._order is None:
            files = expand_files(self._config.input_files)
            counts = [len(o) - 1 for o in record_index.load(files)]
            seed = (DEFAULT_ORDER_SEED if self._config.seed is None
                    else self._config.seed)
            self._order = order_identity.describe(files, counts, seed)
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
    expand_files(config.input_files)
    if config.training and config.service is not None:
        return service_lib.ServiceDatasetFn(
            lambda seed: build(_service_records(config, seed), None, 0),
            config.service)
    if uses_global_order(config):
        return PositionedDatasetFn(functools.partial(build, config), config)
    return DatasetFn(functools.partial(build, config))


def describe_input(config: TFRecordConfig) -> str:
    """"input 16 files, global order (seed 7)", or where the service is."""
    files = len(expand_files(config.input_files))
    if config.service is not None:
        return (f"input {files} files, read by the tf.data service at "
                f"{config.service.address} ({config.service.processing_mode}"
                f", job {config.service.job_name})")
    order = "global" if uses_global_order(config) else "sharded"
    return f"input {files} files, {order} order (seed {config.seed})"


def _service_records(config: TFRecordConfig, seed) -> TFRecordConfig:
    """The config a service worker's pipeline is built from: every trainer
    must register the same graph, so a missing seed becomes a fixed one;
    `seed` (a tensor) overrides it ("parallel_epochs")."""
    if seed is None:
        seed = DEFAULT_ORDER_SEED if config.seed is None else config.seed
    return dataclasses.replace(config, seed=seed)


def uses_global_order(config: TFRecordConfig) -> bool:
    """Training in the global order; False (with a warning) for records it
    cannot read by number (compressed, or not on a local file system)."""
    if (not config.training or config.order != "global"
            or config.service is not None):
        return False
    if config.compression_type:
        logging.warning("tfscale: %s records cannot be read by record number:"
                        " reading them in the sharded order (it depends on "
                        "the worker count)", config.compression_type)
        return False
    files = expand_files(config.input_files)
    remote = [f for f in files if "://" in f]
    if remote:
        logging.warning("tfscale: %s is not on a local file system: reading "
                        "the sharded order (it depends on the worker count)",
                        remote[0])
        return False
    return True


def open_records(files: Sequence[str]) -> RecordReader:
    """A reader of `files` by record number, indexing any file whose index
    is missing or stale (and saying so, with the command that does it ahead
    of time).

    Raises:
        InputError: A file's frames do not read (naming it), or no records.
    """
    def on_built(built, seconds):
        logging.warning(
            "tfscale: indexed %d record file(s) in %.1f s (%s%s); the "
            "writers and `python -m input_pipelines.index_records` do this "
            "ahead of time", len(built), seconds, built[0],
            ", ..." if len(built) > 1 else "")
    try:
        offsets = record_index.load(files, on_built)
    except (record_index.RecordIndexError, OSError) as e:
        raise InputError(f"bad input record: {e}") from None
    reader = RecordReader(files, offsets)
    if reader.num_records == 0:
        raise InputError(f"no records in {len(files)} file(s) "
                         f"({files[0]}, ...)")
    return reader


def check_index(config: TFRecordConfig) -> None:
    """Indexes the training files now (when the global order reads them and
    an index is missing or stale), so a file that does not index fails
    before the model is built.

    Raises:
        InputError: Naming the file.
    """
    if uses_global_order(config):
        open_records(expand_files(config.input_files)).close()


def _global_chunks(config: TFRecordConfig,
                   input_context: Optional[tf.distribute.InputContext],
                   batch_size: int, start_position: int,
                   chunk_records: int) -> tf.data.Dataset:
    """Chunks of (global positions, serialized records) of this pipeline,
    forever, in the global order; a chunk holds whole global micro-batches'
    worth of this pipeline's records (>= `chunk_records`)."""
    files = expand_files(config.input_files)
    reader = open_records(files)
    num = input_context.num_input_pipelines if input_context else 1
    index = input_context.input_pipeline_id if input_context else 0
    local_replicas = (input_context.num_replicas_in_sync // num
                      if input_context else 1)
    try:
        share = partition.Slice(num, index, batch_size * local_replicas,
                                int(start_position))
    except ValueError as e:
        raise InputError(str(e)) from None
    seed = DEFAULT_ORDER_SEED if config.seed is None else config.seed
    micro_batches = max(1, -(-chunk_records // share.per_pipeline_batch))
    logging.info("input pipeline %d/%d: global order of %d records in %d "
                 "files (seed %d), from position %d", index, num,
                 reader.num_records, len(files), seed, start_position)

    def read(chunk):
        positions = share.positions(int(chunk) * micro_batches, micro_batches)
        blob, lengths = reader.read(partition.records_at(
            positions, reader.num_records, seed))
        begins, sizes = split_offsets(lengths)
        return positions, blob, begins, sizes

    def cut(chunk):
        positions, blob, begins, sizes = tf.numpy_function(
            read, [chunk], [tf.int64, tf.string, tf.int64, tf.int64],
            stateful=False)
        records = tf.strings.substr(blob, begins, sizes)
        rows = micro_batches * share.per_pipeline_batch
        return tf.ensure_shape(positions, [rows]), tf.ensure_shape(
            records, [rows])
    return tf.data.Dataset.counter().map(cut)


def _count_gaps(on_skipped):
    """A `scan` step over (index, example): indices missing since the last
    element are records `ignore_errors` skipped; reports the running total."""
    def scan_fn(state, element):
        last, skipped = state
        index, example = element
        skipped = skipped + index - last - 1
        report = tf.cond(index - last > 1, lambda: on_skipped(skipped),
                         tf.no_op)
        with tf.control_dependencies([report]):
            index = tf.identity(index)
        return (index, skipped), (index, example)
    return scan_fn


def _records(config: TFRecordConfig,
             input_context: Optional[tf.distribute.InputContext]):
    """This pipeline's serialized records (sharded, interleaved, cached) and
    whether its order must be deterministic."""
    files = expand_files(config.input_files)
    num = input_context.num_input_pipelines if input_context else 1
    index = input_context.input_pipeline_id if input_context else 0
    own_files, by_file = shard_files(files, num, index)
    if num > 1:
        logging.info("input pipeline %d/%d: sharding by %s (%d of %d files)",
                     index, num, "file" if by_file else "record",
                     len(own_files), len(files))
    # By-record sharding needs the same record order on every pipeline.
    deterministic = config.deterministic or not by_file
    ds = tf.data.Dataset.from_tensor_slices(own_files)
    if config.training and by_file:
        ds = ds.shuffle(len(own_files), seed=config.seed,
                        reshuffle_each_iteration=True)
    interleave_args = {}
    if config.num_parallel_reads is not None:
        interleave_args = dict(num_parallel_calls=config.num_parallel_reads,
                               deterministic=deterministic)
    ds = ds.interleave(
        lambda name: tf.data.TFRecordDataset(
            name, compression_type=config.compression_type,
            buffer_size=8 << 20),
        cycle_length=min(config.cycle_length, len(own_files)),
        block_length=config.block_length, **interleave_args)
    if not by_file:
        ds = ds.shard(num, index)
    if config.skip_corrupt:
        ds = ds.ignore_errors(log_warning=True)
    if config.cache is not None:
        ds = ds.cache("" if config.cache == "memory" else config.cache)
    return ds, deterministic


def dataset_options(deterministic: bool, threadpool_size: Optional[int] = None,
                    autotune_ram_budget: Optional[int] = None) -> tf.data.Options:
    """tf.data options of every tfscale pipeline."""
    options = tf.data.Options()
    options.deterministic = deterministic
    # We shard ourselves; tf.distribute must not (and must not warn).
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    if threadpool_size:
        options.threading.private_threadpool_size = threadpool_size
    if autotune_ram_budget:
        options.autotune.ram_budget = autotune_ram_budget
    return options


def count_records(name: str, compression_type: Optional[str] = None) -> int:
    """Records in one file, read through TensorFlow's reader (which checks
    every record's CRCs: raises tf.errors.DataLossError on a bad one)."""
    ds = tf.data.TFRecordDataset(name, compression_type=compression_type,
                                 buffer_size=8 << 20).batch(4096)
    return int(ds.reduce(tf.constant(0, tf.int64),
                         lambda n, batch: n + tf.size(batch, tf.int64)))


def op_message(error: tf.errors.OpError) -> str:
    """TensorFlow's error text without the function-node and op tags."""
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", error.message.strip())
    return re.sub(r"\s*\[Op:\w+\].*$", "", text.splitlines()[0])


def check_first_record(files: Sequence[str],
                       describe: Callable[[bytes], Optional[str]],
                       compression_type: Optional[str] = None) -> None:
    """Reads one record of the first file and checks it with `describe`
    (`fn(serialized record) -> problem or None`): records of another kind
    or for another model fail here, before training.

    Raises:
        InputError: "FILE: record 0: <problem>", or "FILE: <TF's message>"
            when the file does not read; an empty first file is allowed
            (other files may hold records).
    """
    name = files[0]
    try:
        first = next(iter(tf.data.TFRecordDataset(
            name, compression_type=compression_type).take(1)), None)
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
        raise InputError(
            f"{name}: {op_message(e)}") from None
    if first is None:
        return
    problem = describe(first.numpy())
    if problem:
        raise InputError(f"{name}: record 0: {problem}")


def find_bad_record(files: Sequence[str], parse_fn: Optional[Callable] = None,
                    compression_type: Optional[str] = None,
                    describe: Optional[Callable[[bytes], Optional[str]]] = None
                    ) -> Optional[str]:
    """Scans `files` in order; describes the first unreadable record.

    TensorFlow's errors say "corrupted record at <offset>" or "Key: x ...
    Number of values != expected" without the file. Called after such an
    error, this names it (and, through the parse error, the feature).

    Args:
        files: Record files, in the order to scan.
        parse_fn: The pipeline's batched parse; its errors count as bad.
        compression_type: As in `TFRecordConfig`.
        describe: `fn(serialized record) -> problem or None`, to say what
            is wrong with a record in a batch that failed to parse in words
            the user knows (which flag expects what) rather than TF's.

    Returns:
        "FILE: record N: <problem>" (or "in records N-M: <TF's message>"),
        or None if every record reads and parses.
    """
    for name in files:
        count = 0
        try:
            ds = tf.data.TFRecordDataset(name, compression_type=compression_type)
            for batch in ds.batch(256):
                if parse_fn is not None:
                    try:
                        parse_fn(batch)
                    except tf.errors.InvalidArgumentError:
                        problem = _describe_batch(batch, describe)
                        if problem:
                            index, text = problem
                            return f"{name}: record {count + index}: {text}"
                        raise
                count += int(batch.shape[0])
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
            return (f"{name}: in records {count}-{count + 255}: "
                    f"{op_message(e)}")
    return None


def _describe_batch(batch, describe):
    """(index, problem) of the first record `describe` objects to, or None."""
    if describe is None:
        return None
    for index, record in enumerate(batch.numpy()):
        problem = describe(record)
        if problem:
            return index, problem
    return None
