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
passes with different masks. Output shards are
`<stem>-00000-of-0000N<ext>`, written in parallel threads.
"""

import os
import random
import sys

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
flags.DEFINE_integer("num_threads", 4, "Threads writing shards.")


def main(argv):
    del argv
    from cli import quiet_tensorflow
    quiet_tensorflow(FLAGS.verbosity)
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
    documents = bi.read_documents(lines)
    sentences = [s for d in documents for s in d]
    tokens = iter(bi.tokenize(sentences, FLAGS.vocab_file, FLAGS.do_lower_case))
    documents = [[t for t in (next(tokens) for _ in d) if t] for d in documents]
    config = bi.InstanceConfig(FLAGS.max_seq_length, FLAGS.max_predictions_per_seq,
                            FLAGS.masked_lm_prob, FLAGS.short_seq_prob,
                            FLAGS.dupe_factor)
    instances = bi.create_instances(documents, config, ids,
                                 random.Random(FLAGS.random_seed))
    names = bi.write_shards(instances, FLAGS.output_file, FLAGS.num_output_shards,
                         spec, FLAGS.num_threads)
    print(f"wrote {len(instances)} instances from {len(documents)} documents "
          f"({len(sentences)} sentences, vocab {len(vocab)}) to {len(names)} "
          f"shards: {names[0]} ...")


if __name__ == "__main__":
    app.run(main)
