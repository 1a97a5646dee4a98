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
import glob
import hashlib
import os
import shutil
import time

from absl import flags, logging

from input_pipelines import bert_instances as bi
from input_pipelines import output_claim
from input_pipelines.prepare import buckets, engine
from tfscale.cli import usage_error

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


def fail(message: str):
    usage_error("create_pretraining_data", f"{message}")


@dataclasses.dataclass(frozen=True)
class WriterConfig:
    """What one run writes, from the flags (parsed once, checked here)."""

    inputs: tuple
    output_file: str
    vocab_file: str
    vocab_size: int
    lower_case: bool
    instances: bi.InstanceConfig
    spec: object  # bert_records.BertRecordSpec
    seed: int
    shards: int
    piece_bytes: int
    engine: engine.EngineConfig
    progress: bool


def config_from_flags() -> WriterConfig:
    """FLAGS -> a `WriterConfig`; exits with one line naming the flag."""
    from input_pipelines.bert_records import BertRecordSpec
    from input_pipelines.record_files import expand_files
    if FLAGS.piece_mb < 1:
        fail("--piece_mb must be >= 1")
    if FLAGS.num_output_shards < 1 or FLAGS.dupe_factor < 1:
        fail("--num_output_shards and --dupe_factor must be >= 1")
    try:
        return WriterConfig(
            inputs=tuple(expand_files(FLAGS.input_file,
                                      allow_partial_shards=True)),
            output_file=FLAGS.output_file, vocab_file=FLAGS.vocab_file,
            vocab_size=FLAGS.vocab_size, lower_case=FLAGS.do_lower_case,
            instances=bi.InstanceConfig(
                FLAGS.max_seq_length, FLAGS.max_predictions_per_seq,
                FLAGS.masked_lm_prob, FLAGS.short_seq_prob,
                FLAGS.dupe_factor),
            spec=BertRecordSpec(FLAGS.max_seq_length,
                                FLAGS.max_predictions_per_seq),
            seed=FLAGS.random_seed, shards=FLAGS.num_output_shards,
            piece_bytes=FLAGS.piece_mb << 20,
            engine=engine.config_from_flags(FLAGS, FLAGS.num_processes),
            progress=FLAGS.progress)
    except ValueError as e:
        fail(str(e))


def load_or_learn_vocab(config: WriterConfig) -> list:
    """The vocabulary, learned from the corpus and written first when
    --vocab_file does not exist (in this process: for a corpus beyond one
    host, learn it on a sample and pass it)."""
    if not os.path.exists(config.vocab_file):
        try:
            lines = [line for name in config.inputs
                     for line in buckets.read_text(name)]
        except ValueError as e:
            fail(f"--input_file: {e}")
        logging.info("learning a %d-token vocab from %d lines",
                     config.vocab_size, len(lines))
        vocab = bi.build_vocab(lines, config.vocab_size, config.lower_case)
        del lines
        os.makedirs(os.path.dirname(os.path.abspath(config.vocab_file)),
                    exist_ok=True)
        with open(config.vocab_file, "w", encoding="utf-8") as f:
            f.write("\n".join(vocab) + "\n")
    return bi.load_vocab(config.vocab_file)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run writes: the shards, the bucket folder of its plan, the
    shards an earlier run of the same plan completed."""

    names: list
    workdir: str
    kept: set
    input_bytes: int
    digest: str


def plan_output(config: WriterConfig) -> Layout:
    """The run's plan (`shard_writer.Plan`: its digest covers the inputs by
    name, size and time, the vocabulary, every setting), after refusing
    shards of another count; shards of another plan are removed."""
    from input_pipelines import shard_writer
    names = bi.shard_names(config.output_file, config.shards)
    folder, stem = os.path.split(os.path.abspath(config.output_file))
    stem = os.path.splitext(stem)[0]
    os.makedirs(folder, exist_ok=True)
    with open(config.vocab_file, "rb") as f:
        vocab_digest = hashlib.sha256(f.read()).hexdigest()
    # The inputs by name, size and modification time: the client never
    # reads the corpus.
    stats = [(name, os.path.getsize(name), os.stat(name).st_mtime_ns)
             for name in config.inputs]
    plan = shard_writer.Plan(
        os.path.join(folder, f".{stem}.manifest.json"),
        names, shard_writer.Plan.digest_of(
            vocab_digest, stats, dataclasses.asdict(config.instances),
            config.lower_case, config.seed, config.shards,
            dataclasses.asdict(config.spec)))
    other = shard_writer.other_shards(
        os.path.join(folder, f"{stem}-*-of-*{os.path.splitext(names[0])[1]}"),
        names)
    if other:
        fail(f"--num_output_shards={config.shards}: {folder} already holds "
             f"{other[0]} ({len(other)} files of another shard count, which "
             "a glob of the shards would read too); remove them or choose "
             "another --output_file")
    try:
        kept = plan.keep()
    except shard_writer.OutputError as e:
        fail(str(e))
    workdir = os.path.join(folder, f".{stem}.buckets-{plan.digest[:16]}")
    # Other plans' bucket folders (runs killed before they ended): this
    # run holds the output's claim, so no one writes them.
    for stale in glob.glob(os.path.join(glob.escape(folder),
                                        f".{glob.escape(stem)}.buckets-*")):
        if stale != workdir:
            shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    return Layout(names, workdir, kept, sum(size for _, size, _ in stats),
                  plan.digest)


def write_shards(config: WriterConfig, layout: Layout, ids) -> tuple:
    """Both stages on one set of processes; returns ((documents, instances)
    per written shard, temporary files removed)."""
    from input_pipelines import shard_writer
    todo = [g for g in range(config.shards) if g not in layout.kept]
    if not todo:
        return [], shard_writer.remove_leftovers(layout.names)
    # One per core, but no more than the corpus pays back.
    processes = engine.processes_for(config.engine.processes, len(todo),
                                     layout.input_bytes,
                                     CORPUS_BYTES_PER_PROCESS)
    leftovers = shard_writer.remove_leftovers(layout.names)
    try:
        with engine.Session(config.engine, processes) as session:
            # Stage one: every input file's documents into the buckets.
            parts = session.run(
                [buckets.SplitTask(name, i, config.shards, config.seed,
                                   layout.workdir, config.piece_bytes)
                 for i, name in enumerate(config.inputs)],
                buckets.split_file, work=[1] * len(config.inputs),
                describe=lambda t: t.path, unit="input file",
                show_progress=config.progress)
            per_bucket = [sum(p["documents"][g] for p in parts)
                          for g in range(config.shards)]
            if sum(per_bucket) < config.shards:
                fail(f"--num_output_shards={config.shards} is more than the "
                     f"{sum(per_bucket)} documents of --input_file")
            # Stage two: one bucket -> one output shard.
            results = session.run(
                [bi.ShardTask(layout.names[g], layout.workdir,
                              tuple(buckets.bucket_ranges(parts, g)),
                              config.vocab_file, config.lower_case,
                              config.instances, ids, f"{config.seed}/{g}",
                              config.spec, config.piece_bytes)
                 for g in todo],
                bi.write_instance_shard,
                work=[per_bucket[g] * config.instances.dupe_factor
                      for g in todo],
                describe=lambda t: os.path.basename(t.name), unit="document",
                show_progress=config.progress)
    except BaseException as e:
        # After an error the engine stops the running tasks and waits for
        # them; unless some still run, what they left half-written goes.
        if not engine.still_running(e):
            shard_writer.remove_leftovers(layout.names)
            buckets.remove_leftovers(layout.workdir)
        if isinstance(e, (OSError, ValueError, engine.TaskError)):
            fail(str(e))
        raise
    leftovers += shard_writer.remove_leftovers(layout.names)
    leftovers += buckets.remove_leftovers(layout.workdir)
    return results, leftovers


def main(argv):
    del argv
    from tfscale.cli import quiet_tensorflow
    quiet_tensorflow(FLAGS.verbosity)
    config = config_from_flags()
    folder, stem = os.path.split(os.path.abspath(config.output_file))
    try:
        with output_claim.claim(folder, os.path.splitext(stem)[0],
                                "create_pretraining_data") as held:
            vocab = load_or_learn_vocab(config)
            ids = bi.SpecialIds(vocab.index("[CLS]"), vocab.index("[SEP]"),
                                vocab.index("[MASK]"), len(vocab))
            layout = plan_output(config)
            if held:
                held.note_plan(layout.digest)
            start = time.monotonic()
            results, leftovers = write_shards(config, layout, ids)
            shutil.rmtree(layout.workdir, ignore_errors=True)
            seconds = time.monotonic() - start
    except output_claim.ClaimError as e:
        fail(str(e))
    made = sum(r[0] for r in results)
    instances = sum(r[1] for r in results)
    notes = (f"; kept {len(layout.kept)} complete shards of an earlier run"
             if layout.kept else "")
    if leftovers:
        notes += (f"; removed {leftovers} temporary file(s) of attempts that "
                  "died")
    print(f"wrote {instances} instances from {made} documents "
          f"(x{config.instances.dupe_factor} passes) in {seconds:.1f} s "
          f"({made / max(seconds, 1e-9):.1f} documents/s, "
          f"{instances / max(seconds, 1e-9):.1f} instances/s; vocab "
          f"{len(vocab)}){notes}: {len(layout.names)} shards: "
          f"{layout.names[0]} ...")


def run():
    """The console script."""
    from tfscale.cli import run_main
    run_main("create_pretraining_data", main,
             required=("input_file", "output_file", "vocab_file"))


if __name__ == "__main__":
    run()
