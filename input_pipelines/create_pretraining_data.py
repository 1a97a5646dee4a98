r"""Plain text -> BERT pretraining TFRecords (Google's format and algorithm).

    python -m input_pipelines.create_pretraining_data \
        --input_file=corpus/*.txt --vocab_file=vocab.txt \
        --output_file=records/train.tfrecord --num_output_shards=8 \
        --max_seq_length=128 --max_predictions_per_seq=20 --dupe_factor=5

Input: one sentence per line, a blank line between documents (as Google's
tool takes). WordPiece tokenization is tensorflow-text's `BertTokenizer`; if
--vocab_file does not exist, a vocabulary of --vocab_size is learned from the
corpus with tensorflow-text's `bert_vocab_from_dataset` and written there.
Instances follow Google's `create_pretraining_data.py`: sentence-pair
sampling with 50% random next sentences, `short_seq_prob` shorter targets,
15% masking (80% [MASK], 10% random token, 10% unchanged), `dupe_factor`
passes with different masks.

At scale, in two stages of tasks (`input_pipelines/prepare`), run in this
process, in local processes (a Dask LocalCluster; --num_processes) or on a
running Dask scheduler's workers (--scheduler, --scheduler_file: SLURM,
Kubernetes): each input file (plain or .gz) is read by one task, a piece of
about --piece_mb at a time cut at document boundaries, which puts each
document in a bucket by a stable hash of (seed, document); each bucket then
becomes one output shard `<stem>-00000-of-0000N<ext>` (tokenization into a
file of ids, instances with the shard's own seed, random next sentences
drawn from the same shard, streamed to the writer through a shuffle of
spill files). Every shard mixes documents of every input file. Memory per
task is about --piece_mb plus 16 bytes per sentence of its shard, whatever
the input's size (benchmarks/README.md has the measured peaks); a task that
kills its worker anyway (--worker_memory) ends the job with one line naming
its input and that limit. The client only lists the files and hands each
stage-two task its byte ranges. The bytes are the same whatever runs the
tasks and whatever --piece_mb is. A progress bar shows each stage's
progress, rate and ETA; the last line reports documents/s. A shard appears
under its name only when complete, and a rerun of the same command after a
crash (same inputs by name, size and time, vocab and flags: the digest in
`.<stem>.manifest.json`) keeps the complete shards and writes only the
missing ones, with the same bytes as an uninterrupted run. After an error
the running tasks are stopped and every temporary file is removed.
"""

import dataclasses
import hashlib
import os
import shutil
import sys
import time

from absl import app, flags, logging

from input_pipelines import bert_instances as bi
from input_pipelines.prepare import buckets, engine

FLAGS = flags.FLAGS
flags.DEFINE_string("input_file", None, "Text files (globs, comma list).")
flags.DEFINE_string("output_file", None, "Output records; shards get "
                    "-0000i-of-0000N before the extension.")
flags.DEFINE_string("vocab_file", None, "WordPiece vocab; learned from the "
                    "corpus and written here if it does not exist.")
flags.DEFINE_integer("vocab_size", 8000, "Size of a learned vocab.")
flags.DEFINE_bool("do_lower_case", True, "Lower-case the text.")
flags.DEFINE_integer("max_seq_length", 128, "Tokens per instance.")
flags.DEFINE_integer("max_predictions_per_seq", 20, "Masked tokens per instance.")
flags.DEFINE_float("masked_lm_prob", 0.15, "Fraction of tokens masked.")
flags.DEFINE_float("short_seq_prob", 0.1, "Chance of a shorter target.")
flags.DEFINE_integer("dupe_factor", 10, "Passes over the corpus.")
flags.DEFINE_integer("random_seed", 12345, "Seed.")
flags.DEFINE_integer("num_output_shards", 1, "Output files.")
flags.DEFINE_integer("num_processes", 0, "Writer processes (0: one per "
                     "core; fewer for small corpora).")
flags.DEFINE_integer("piece_mb", buckets.PIECE_BYTES >> 20, "Memory: input "
                     "files and buckets are read this many MiB at a time, "
                     "cut at document boundaries (the bytes written do not "
                     "depend on it).")
flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")
engine.define_flags(flags)

# A writer process imports TensorFlow (a few seconds): it pays back from
# about 2,000 documents, about 4 MB of text (the demo corpus's documents).
CORPUS_BYTES_PER_PROCESS = 4 << 20


def main(argv):
    del argv
    from tfscale.edge import quiet_tensorflow
    quiet_tensorflow(FLAGS.verbosity)
    from input_pipelines import shard_writer
    from input_pipelines.bert_records import BertRecordSpec
    from input_pipelines.record_files import expand_files
    for name in ("input_file", "output_file", "vocab_file"):
        if not getattr(FLAGS, name):
            sys.exit(f"create_pretraining_data: error: --{name} is required")
    try:
        engine_config = engine.config_from_flags(
            FLAGS, FLAGS.num_processes)
    except ValueError as e:
        sys.exit(f"create_pretraining_data: error: {e}")
    if FLAGS.piece_mb < 1:
        sys.exit("create_pretraining_data: error: --piece_mb must be >= 1")
    piece_bytes = FLAGS.piece_mb << 20
    if FLAGS.num_output_shards < 1 or FLAGS.dupe_factor < 1:
        sys.exit("create_pretraining_data: error: --num_output_shards and "
                 "--dupe_factor must be >= 1")
    try:
        inputs = expand_files(FLAGS.input_file)
        spec = BertRecordSpec(FLAGS.max_seq_length, FLAGS.max_predictions_per_seq)
    except ValueError as e:
        sys.exit(f"create_pretraining_data: error: {e}")
    if not os.path.exists(FLAGS.vocab_file):
        # Learning a vocabulary reads the corpus here, in one process: for
        # a corpus beyond one host, learn it on a sample and pass it.
        try:
            lines = [line for name in inputs for line in buckets.read_text(name)]
        except ValueError as e:
            sys.exit(f"create_pretraining_data: error: --input_file: {e}")
        logging.info("learning a %d-token vocab from %d lines",
                     FLAGS.vocab_size, len(lines))
        vocab = bi.build_vocab(lines, FLAGS.vocab_size, FLAGS.do_lower_case)
        del lines
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.vocab_file)),
                    exist_ok=True)
        with open(FLAGS.vocab_file, "w", encoding="utf-8") as f:
            f.write("\n".join(vocab) + "\n")
    vocab = bi.load_vocab(FLAGS.vocab_file)
    ids = bi.SpecialIds(vocab.index("[CLS]"), vocab.index("[SEP]"),
                     vocab.index("[MASK]"), len(vocab))
    shards = FLAGS.num_output_shards
    config = bi.InstanceConfig(FLAGS.max_seq_length, FLAGS.max_predictions_per_seq,
                               FLAGS.masked_lm_prob, FLAGS.short_seq_prob,
                               FLAGS.dupe_factor)
    names = bi.shard_names(FLAGS.output_file, shards)
    folder, stem = os.path.split(os.path.abspath(FLAGS.output_file))
    stem = os.path.splitext(stem)[0]
    os.makedirs(folder, exist_ok=True)
    with open(FLAGS.vocab_file, "rb") as f:
        vocab_digest = hashlib.sha256(f.read()).hexdigest()
    # The inputs by name, size and modification time: the client never
    # reads the corpus.
    stats = [(name, os.path.getsize(name), os.stat(name).st_mtime_ns)
             for name in inputs]
    plan = shard_writer.Plan(
        os.path.join(folder, f".{stem}.manifest.json"),
        names, shard_writer.Plan.digest_of(
            vocab_digest, stats, dataclasses.asdict(config),
            FLAGS.do_lower_case, FLAGS.random_seed, shards,
            dataclasses.asdict(spec)))
    other = shard_writer.other_shards(
        os.path.join(folder, f"{stem}-*-of-*{os.path.splitext(names[0])[1]}"),
        names)
    if other:
        sys.exit(f"create_pretraining_data: error: --num_output_shards="
                 f"{shards}: {folder} already holds {other[0]} ({len(other)} "
                 "files of another shard count, which a glob of the shards "
                 "would read too); remove them or choose another "
                 "--output_file")
    kept = plan.keep()
    workdir = os.path.join(folder, f".{stem}.buckets-{plan.digest[:16]}")
    os.makedirs(workdir, exist_ok=True)
    start = time.monotonic()
    leftovers = shard_writer.remove_leftovers(names)
    todo = [g for g in range(shards) if g not in kept]
    # One set of processes for both stages: one per core, but no more than
    # the corpus pays back (CORPUS_BYTES_PER_PROCESS each).
    processes = engine.processes_for(
        engine_config.processes, len(todo),
        sum(size for _, size, _ in stats) if todo else 0,
        CORPUS_BYTES_PER_PROCESS)
    try:
        with engine.Session(engine_config, processes) as session:
            # Stage one: every input file's documents into the shards' buckets.
            parts = session.run(
                [buckets.SplitTask(name, i, shards, FLAGS.random_seed, workdir,
                                   piece_bytes)
                 for i, name in enumerate(inputs)] if todo else [],
                buckets.split_file, work=[1] * (len(inputs) if todo else 0),
                describe=lambda t: t.path, unit="input file",
                show_progress=FLAGS.progress)
            per_bucket = [sum(p["documents"][g] for p in parts)
                          for g in range(shards)]
            if todo and sum(per_bucket) < shards:
                sys.exit(f"create_pretraining_data: error: --num_output_shards="
                         f"{shards} is more than the {sum(per_bucket)} documents "
                         "of --input_file")
            # Stage two: one bucket -> one output shard.
            results = session.run(
                [bi.ShardTask(names[g], workdir,
                              tuple(buckets.bucket_ranges(parts, g)),
                              FLAGS.vocab_file, FLAGS.do_lower_case, config,
                              ids, f"{FLAGS.random_seed}/{g}", spec,
                              piece_bytes) for g in todo],
                bi.write_instance_shard,
                work=[per_bucket[g] * FLAGS.dupe_factor for g in todo],
                describe=lambda t: os.path.basename(t.name), unit="document",
                show_progress=FLAGS.progress)
    except (OSError, ValueError, engine.TaskError) as e:
        sys.exit(f"create_pretraining_data: error: {e}")
    finally:
        # No attempt runs now (after an error the engine stops the running
        # tasks and waits for them): what they left half-written goes.
        leftovers += shard_writer.remove_leftovers(names)
        leftovers += buckets.remove_leftovers(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.monotonic() - start
    made = sum(r[0] for r in results)
    instances = sum(r[1] for r in results)
    kept_note = (f"; kept {len(kept)} complete shards of an earlier run"
                 if kept else "")
    if leftovers:
        kept_note += (f"; removed {leftovers} temporary file(s) of attempts "
                      "that died")
    print(f"wrote {instances} instances from {made} documents "
          f"(x{FLAGS.dupe_factor} passes) in {seconds:.1f} s "
          f"({made / max(seconds, 1e-9):.1f} documents/s, "
          f"{instances / max(seconds, 1e-9):.1f} instances/s; vocab "
          f"{len(vocab)}){kept_note}: {len(names)} shards: {names[0]} ...")


def run():
    """The console script."""
    from tfscale.edge import list_flags_in_help
    list_flags_in_help()
    app.run(main)


if __name__ == "__main__":
    run()
