r"""A small real English corpus, made on this machine with no download.

    python -m input_pipelines.make_demo_corpus --output_dir=runs/demo/corpus

The text is Python's own language reference help (`pydoc_data.topics`, about
450k characters, shipped with every CPython). Each help topic becomes a
document, one sentence per line, blank lines between documents: the input
format of `create_pretraining_data`. Also writes a WordPiece vocab learned
from it (tensorflow-text) and a Google-format `bert_config.json` for BERT-tiny
with that vocab's size.
"""

import json
import os

from absl import flags

from input_pipelines import bert_instances as bi
from input_pipelines.demo_corpus import corpus_documents, tiny_bert_config

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "runs/demo/corpus", "Where to write.")
flags.DEFINE_integer("vocab_size", 4000, "WordPiece vocab size to learn.")

def main(argv):
    del argv
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    documents = corpus_documents()
    corpus = os.path.join(FLAGS.output_dir, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(d) for d in documents) + "\n")
    vocab_path = os.path.join(FLAGS.output_dir, "vocab.txt")
    lines = [s for d in documents for s in d]
    if not os.path.exists(vocab_path):
        vocab = bi.build_vocab(lines, FLAGS.vocab_size)
        with open(vocab_path, "w", encoding="utf-8") as f:
            f.write("\n".join(vocab) + "\n")
    vocab_size = len(bi.load_vocab(vocab_path))
    # Round up to a multiple of 8 (tensor cores); extra rows are unused.
    config = tiny_bert_config(-(-vocab_size // 8) * 8)
    with open(os.path.join(FLAGS.output_dir, "bert_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"corpus: {len(documents)} documents, {len(lines)} sentences, "
          f"{sum(map(len, lines))} characters -> {corpus}; vocab {vocab_size}")


if __name__ == "__main__":
    # (A missing extra, tensorflow-text for the vocabulary: one line.)
    from tfscale.cli import run_main
    run_main("make_demo_corpus", main)
