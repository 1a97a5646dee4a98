"""The TFRecord pipeline builders, for any feature spec.

The files themselves (patterns, sharding, reading by record number) are
`record_files.py`; what the Trainer calls to build each worker's pipelines
is `dataset_fns.py`; checking records and naming a bad one is
`record_checks.py`.

    files -> shard per input pipeline -> shuffle files -> interleave
    -> [shard by record] -> [cache] -> shuffle blocks of records -> repeat
    -> chunks of records -> one vectorized parse per chunk -> [transform]
    -> rebatch to the batch size -> prefetch

Batch first, then parse the whole batch with one `tf.io.parse_example`: the
fused map-and-batch of today, about 6x faster on 2 cores than parsing each
example (docs/facts.md, fact 5). `parse_example` is cheaper per record on bigger
batches, so records are parsed in chunks of `parse_chunk_size` (2,048-4,096)
and the parsed tensors are then sliced into batches with `rebatch`. Nothing
runs per record on the hot path: no per-record map, no file-name tagging.
When a read or parse fails, `record_checks.find_bad_record` scans the files
on the host and names the file and the feature.

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
from typing import Callable, Mapping, Optional, Sequence, Union

import tensorflow as tf
from absl import logging

from input_pipelines import service as service_lib
from input_pipelines.record_files import (InputError, expand_files,
                                          open_records, shard_files)
from input_pipelines.record_order import partition
from input_pipelines.record_order.reader import split_offsets

AUTOTUNE = tf.data.AUTOTUNE
ORDERS = ("global", "sharded")
# Seed of the global order when the config gives none: every worker must
# compute the same permutation.
DEFAULT_ORDER_SEED = 0
# Records per read in the image pipeline (JPEGs: ~100 KB each).
EXAMPLE_READ_RECORDS = 64


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
        verify_records: The global order's reader checks every record's
            CRC-32C as it reads it (`record_order/reader.py`); the sharded
            order's `TFRecordDataset` always does.
        allow_partial_shards: Train on a glob that matches part of a shard
            set `NAME-i-of-N` (a writer that did not finish); refused
            otherwise (`partial_shards`; evaluation sets take any part).
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
    verify_records: bool = True
    allow_partial_shards: bool = False

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


def partial_shards(config: TFRecordConfig) -> bool:
    """Whether a glob may match part of a `NAME-i-of-N` shard set: for
    evaluation (one shard of a set is a common choice), or when asked."""
    return config.allow_partial_shards or not config.training


def describe_input(config: TFRecordConfig) -> str:
    """"input 16 files, global order (seed 7)", or where the service is."""
    files = len(expand_files(config.input_files,
                         partial_shards(config)))
    if config.service is not None:
        return (f"input {files} files, read by the tf.data service at "
                f"{config.service.address} ({config.service.processing_mode}"
                f", job {config.service.job_name})")
    order = "global" if uses_global_order(config) else "sharded"
    unchecked = ("; CRCs not checked (--verify_records=false)"
                 if order == "global" and not config.verify_records else "")
    return f"input {files} files, {order} order (seed {config.seed}){unchecked}"


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
    files = expand_files(config.input_files,
                         partial_shards(config))
    remote = [f for f in files if "://" in f]
    if remote:
        logging.warning("tfscale: %s is not on a local file system: reading "
                        "the sharded order (it depends on the worker count)",
                        remote[0])
        return False
    return True


def check_index(config: TFRecordConfig) -> None:
    """Indexes the training files now (when the global order reads them and
    an index is missing or stale), so a file that does not index fails
    before the model is built.

    Raises:
        InputError: Naming the file.
    """
    if uses_global_order(config):
        open_records(expand_files(config.input_files,
                         partial_shards(config))).close()


def _global_chunks(config: TFRecordConfig,
                   input_context: Optional[tf.distribute.InputContext],
                   batch_size: int, start_position: int,
                   chunk_records: int) -> tf.data.Dataset:
    """Chunks of (global positions, serialized records) of this pipeline,
    forever, in the global order; a chunk holds whole global micro-batches'
    worth of this pipeline's records (>= `chunk_records`)."""
    files = expand_files(config.input_files,
                         partial_shards(config))
    reader = open_records(files, verify_records=config.verify_records)
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
    files = expand_files(config.input_files,
                         partial_shards(config))
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


