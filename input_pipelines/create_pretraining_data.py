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

At scale: the documents are dealt round-robin to the output shards
`<stem>-00000-of-0000N<ext>`, and each shard is made by its own process
(one per core; tokenization, instances, serialization) from its documents
with its own seed, random next sentences drawn from the same shard, as when
Google's tool is run once per input file. A progress bar shows documents,
rate and ETA; the last line reports documents/s. A rerun of the same
command after a crash keeps the complete shards (same corpus, vocab and
flags: the digest in `.<stem>.manifest.json`) and writes only the missing
ones, with the same bytes as an uninterrupted run.
"""

import dataclasses
import hashlib
import os
import sys
import time

from absl import app, flags, logging

from input_pipelines import bert_instances as bi

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
flags.DEFINE_integer("num_threads", None, "Deprecated: --num_processes.")
flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")

DOCUMENTS_PER_PROCESS = 2000  # a process imports TensorFlow: a few seconds


def main(argv):
    del argv
    from cli import quiet_tensorflow
    quiet_tensorflow(FLAGS.verbosity)
    from input_pipelines import shard_writer
    from input_pipelines.bert_records import BertRecordSpec
    for name in ("input_file", "output_file", "vocab_file"):
        if not getattr(FLAGS, name):
            sys.exit(f"create_pretraining_data: error: --{name} is required")
    if FLAGS.num_output_shards < 1 or FLAGS.dupe_factor < 1:
        sys.exit("create_pretraining_data: error: --num_output_shards and "
                 "--dupe_factor must be >= 1")
    try:
        lines = bi.read_lines(FLAGS.input_file)
        spec = BertRecordSpec(FLAGS.max_seq_length, FLAGS.max_predictions_per_seq)
    except ValueError as e:
        sys.exit(f"create_pretraining_data: error: {e}")
    if not os.path.exists(FLAGS.vocab_file):
        logging.info("learning a %d-token vocab from %d lines",
                     FLAGS.vocab_size, len(lines))
        vocab = bi.build_vocab(lines, FLAGS.vocab_size, FLAGS.do_lower_case)
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.vocab_file)),
                    exist_ok=True)
        with open(FLAGS.vocab_file, "w", encoding="utf-8") as f:
            f.write("\n".join(vocab) + "\n")
    vocab = bi.load_vocab(FLAGS.vocab_file)
    ids = bi.SpecialIds(vocab.index("[CLS]"), vocab.index("[SEP]"),
                     vocab.index("[MASK]"), len(vocab))
    documents = [d for d in bi.read_documents(lines) if d]
    shards = FLAGS.num_output_shards
    if shards > len(documents):
        sys.exit(f"create_pretraining_data: error: --num_output_shards="
                 f"{shards} is more than the {len(documents)} documents of "
                 f"--input_file (each shard is made from its own documents)")
    config = bi.InstanceConfig(FLAGS.max_seq_length, FLAGS.max_predictions_per_seq,
                               FLAGS.masked_lm_prob, FLAGS.short_seq_prob,
                               FLAGS.dupe_factor)
    names = bi.shard_names(FLAGS.output_file, shards)
    folder, stem = os.path.split(os.path.abspath(FLAGS.output_file))
    os.makedirs(folder, exist_ok=True)
    with open(FLAGS.vocab_file, "rb") as f:
        vocab_digest = hashlib.sha256(f.read()).hexdigest()
    corpus = hashlib.sha256()
    for line in lines:
        corpus.update(line.encode("utf-8") + b"\n")
    tasks = [bi.ShardTask(names[g], tuple(tuple(d) for d in documents[g::shards]),
                          FLAGS.vocab_file, FLAGS.do_lower_case, config, ids,
                          f"{FLAGS.random_seed}/{g}", spec)
             for g in range(shards)]
    plan = shard_writer.Plan(
        os.path.join(folder, f".{os.path.splitext(stem)[0]}.manifest.json"),
        names, shard_writer.Plan.digest_of(
            vocab_digest, corpus.hexdigest(), dataclasses.asdict(config),
            FLAGS.do_lower_case, [t.seed for t in tasks],
            dataclasses.asdict(spec)))
    kept = plan.keep()
    todo = [tasks[g] for g in range(shards) if g not in kept]
    work = [len(t.documents) * FLAGS.dupe_factor for t in tasks]
    start = time.monotonic()
    results = shard_writer.run(
        todo, bi.write_instance_shard, unit="document",
        total=sum(work), initial=sum(work[g] for g in kept),
        show_progress=FLAGS.progress,
        processes=shard_writer.processes_for(
            FLAGS.num_threads or FLAGS.num_processes, len(todo),
            sum(len(t.documents) for t in todo), DOCUMENTS_PER_PROCESS))
    seconds = time.monotonic() - start
    made = sum(r[0] for r in results)
    instances = sum(r[1] for r in results)
    kept_note = (f"; kept {len(kept)} complete shards of an earlier run"
                 if kept else "")
    print(f"wrote {instances} instances from {made} documents "
          f"(x{FLAGS.dupe_factor} passes) in {seconds:.1f} s "
          f"({made / max(seconds, 1e-9):.1f} documents/s, "
          f"{instances / max(seconds, 1e-9):.1f} instances/s; vocab "
          f"{len(vocab)}){kept_note}: {len(names)} shards: {names[0]} ...")


if __name__ == "__main__":
    app.run(main)
