r"""Input pipeline benchmark: is the pipeline ever the bottleneck?

    python -m benchmarks.pipelines.input_pipeline [--records 131072] [--files 16]

On generated BERT records of realistic size (seq 128, 20 predictions), in one
run, measures examples/s of:
  naive     sequential read, per-example parse_single_example, batch, no prefetch
  model_garden  the shape of Model Garden's BertPretrainDataLoader (parallel
            interleave, shuffle buffer, parallel per-record parse, batch)
  ours      the BERT job's pipeline (`bert_records.make_dataset_fn`, the id
            checks included), global record order (read by record number,
            batch-then-parse, prefetch): the default of run_pretraining.py
  sharded   the same in the sharded order (interleave, block shuffle)
  +step     ours / sharded through distribute_datasets_from_function feeding
            a trivial model step under the strategy (does it keep up?)
  ceiling   reading alone (one reader, batched) plus parsing alone
            (pre-batched records in memory, one thread per core): their
            per-example core costs added, spread over all cores
and prints a table of ratios. Results go in benchmarks/README.md.
"""

import argparse
import os
import statistics
import tempfile
import time

import tensorflow as tf

from benchmarks import harness
from input_pipelines import bert_records, record_checks, tfrecord
from input_pipelines.synthetic_bert import SPEC, write_records


def examples_per_second(dataset, batch_size, warmup=40, batches=400):
    iterator = iter(dataset)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batch_size * batches / (time.perf_counter() - start)


def naive(files, batch_size):
    spec = bert_records.feature_spec(SPEC)
    ds = tf.data.TFRecordDataset(files).repeat()
    ds = ds.map(lambda r: tf.io.parse_single_example(r, spec))
    options = tf.data.Options()
    # The naive pipeline must stay naive: no automatic fusion or prefetch.
    options.experimental_optimization.apply_default_optimizations = False
    options.autotune.enabled = False
    return ds.batch(batch_size).with_options(options)


def model_garden(files, batch_size):
    """The shape of Model Garden's `BertPretrainDataLoader` in training
    (`official/core/input_reader.py`, read 2026-11-26): the files shuffled
    and repeated, interleaved with parallel reads, a shuffle buffer of 100
    records, `parse_single_example` and an int32 cast per record (parallel
    maps), batch, prefetch; tf.data's default optimizations on."""
    spec = bert_records.feature_spec(SPEC)

    def decode(record):
        example = tf.io.parse_single_example(record, spec)
        return {k: tf.cast(v, tf.int32) if v.dtype == tf.int64 else v
                for k, v in example.items()}

    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files),
                                                           seed=0).repeat()
    ds = ds.interleave(tf.data.TFRecordDataset,
                       num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=False)
    ds = ds.shuffle(100, seed=0)
    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def ours(files, batch_size, order="global", verify_records=True):
    config = tfrecord.TFRecordConfig(files, training=True, seed=0, order=order,
                                     verify_records=verify_records)
    dataset_fn = bert_records.make_dataset_fn(
        config, SPEC, batch_size, bert_records.IdLimits(30522, 2))
    return dataset_fn(tf.distribute.InputContext())


def index_cost(files):
    """(seconds to index the files from the page cache, with CRC check;
    index bytes on disk), the global order's one-time cost."""
    from input_pipelines.record_order import index as record_index
    for name in files:
        if os.path.exists(record_index.index_path(name)):
            os.remove(record_index.index_path(name))
    start = time.perf_counter()
    record_index.load(files)
    scan = time.perf_counter() - start
    start = time.perf_counter()
    for name in files:
        record_checks.count_records(name)
    verify = time.perf_counter() - start
    size = sum(os.path.getsize(record_index.index_path(f)) for f in files)
    return scan, verify, size


def ours_feeding_a_step(files, batch_size, steps=400, warmup=40,
                        order="global"):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    dataset_fn = bert_records.make_dataset_fn(
        tfrecord.TFRecordConfig(files, training=True, seed=0, order=order),
        SPEC, batch_size)
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))

    @tf.function
    def step(batch):
        def replica(inputs, labels):
            # A trivial model: touches every input tensor.
            return (tf.reduce_sum(tf.cast(inputs["input_ids"], tf.float32)) +
                    tf.reduce_sum(labels["masked_lm_weights"]))
        return strategy.run(replica, args=batch)

    for _ in range(warmup):
        step(next(iterator))
    start = time.perf_counter()
    for _ in range(steps):
        value = step(next(iterator))
    float(strategy.experimental_local_results(value)[0])
    return batch_size * steps / (time.perf_counter() - start)


def reading_alone(files, batch_size):
    """One reader, batched, no parse: the single-core cost of reading."""
    ds = tf.data.TFRecordDataset(files, buffer_size=8 << 20).repeat()
    return examples_per_second(ds.batch(batch_size).prefetch(4), batch_size)


def parsing_alone(files, batch_size, threads):
    """Vectorized parse of pre-batched records held in memory."""
    batches = list(tf.data.TFRecordDataset(files).batch(batch_size,
                                                        drop_remainder=True)
                   .take(64))
    spec = bert_records.feature_spec(SPEC)
    ds = tf.data.Dataset.from_tensor_slices(tf.stack(batches)).repeat()
    ds = ds.map(lambda s: tf.io.parse_example(s, spec),
                num_parallel_calls=threads).prefetch(4)
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    return examples_per_second(ds.with_options(options), batch_size)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=131072,
                        help="synthetic BERT records written")
    parser.add_argument("--files", type=int, default=16,
                        help="files they are written to")
    parser.add_argument("--batch_size", type=int, default=256,
                        help="examples a batch")
    parser.add_argument("--data_dir", default=None,
                        help="where the records go (default: a temporary "
                             "folder)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each measurement is repeated")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    directory = args.data_dir or tempfile.mkdtemp(prefix="tfscale-bench-")
    files = sorted(tf.io.gfile.glob(os.path.join(directory, "bert-*.tfrecord")))
    if len(files) != args.files:
        files = write_records(directory, args.records, args.files)
    # Warm the page cache so every variant reads from memory.
    for name in files:
        with open(name, "rb") as f:
            while f.read(1 << 24):
                pass
    b = args.batch_size
    # This machine is noisy (about +-20% run to run): every variant is
    # measured --repeats times, interleaved, and the median is reported.
    # ours+step runs last: the strategy's distributed iterator keeps threads
    # busy after its measurement, which slowed whatever ran next by about 10%.
    scan, verify, index_bytes = index_cost(files)
    samples = {k: [] for k in ("naive", "model_garden", "ours",
                               "ours, CRCs off", "sharded",
                               "ours+step", "sharded+step", "read", "parse")}
    for _ in range(args.repeats):
        samples["naive"].append(examples_per_second(naive(files, b), b))
        samples["model_garden"].append(examples_per_second(
            model_garden(files, b), b))
        samples["ours"].append(examples_per_second(ours(files, b), b))
        samples["ours, CRCs off"].append(examples_per_second(
            ours(files, b, verify_records=False), b))
        samples["sharded"].append(examples_per_second(
            ours(files, b, "sharded"), b))
        samples["read"].append(reading_alone(files, b))
        samples["parse"].append(parsing_alone(files, b, cores))
    for _ in range(args.repeats):
        samples["ours+step"].append(ours_feeding_a_step(files, b))
        samples["sharded+step"].append(ours_feeding_a_step(files, b,
                                                           order="sharded"))
    median = {k: statistics.median(v) for k, v in samples.items()}
    results = {k: median[k] for k in ("naive", "model_garden", "ours",
                                      "ours, CRCs off", "sharded", "ours+step", "sharded+step")}
    read, parse = median["read"], median["parse"]
    core_seconds = 1.0 / read + cores / parse  # per example
    results["ceiling"] = cores / core_seconds
    print(f"{args.records} records, {len(files)} files, batch {b}, {cores} "
          f"cores, median of {args.repeats}")
    print(f"reading alone {read:,.0f}/s (1 thread), parsing alone "
          f"{parse:,.0f}/s ({cores} threads): {1e6 * core_seconds:.2f} "
          f"core-us per example")
    million = 1e6 / args.records
    print(f"record index: {scan * million:.2f} s per million records to "
          f"scan and write, {verify * million:.2f} s per million to check "
          f"CRCs (index_records), {index_bytes / args.records:.1f} bytes per "
          f"record on disk; ours / sharded "
          f"{median['ours'] / median['sharded']:.2f}")
    table = harness.Table(["pipeline", "examples/s", "vs naive",
                           "vs Model Garden", "vs ceiling"])
    for name, rate in results.items():
        table.row(name, f"{rate:,.0f}", f"{rate / results['naive']:.2f}",
                  f"{rate / results['model_garden']:.2f}",
                  f"{rate / results['ceiling']:.2f}")


if __name__ == "__main__":
    main()
