r"""Export a tfscale BERT checkpoint for downstream use.

    python export_bert.py --checkpoint=runs/bert/checkpoints \
        --bert_config_file=bert_config.json --output_dir=runs/bert/export

`--checkpoint` is a checkpoint prefix or a directory (its latest checkpoint).
Writes what `models.bert_export` describes (`bert_config.json`,
`bert_pretrainer.weights.h5`, `encoder.weights.h5`) and, for Google's tools
(`run_classifier.py` and friends), a TF1 name-based `bert_model.ckpt` with
Google's variable names, plus `vocab.txt` with `--vocab_file`.
`run_pretraining.py` writes the Keras files at the end of every run, into
`<output_dir>/export`.
"""

import os
import shutil

from absl import flags
from tfscale.cli import usage_error

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Checkpoint prefix or directory "
                    "(required).")
flags.DEFINE_string("bert_config_file", None, "Google bert_config.json "
                    "(required).")
flags.DEFINE_string("output_dir", None, "Where to write the export "
                    "(required).")
flags.DEFINE_bool("google_checkpoint", True,
                  "Also write Google's TF1 name-based bert_model.ckpt.")
flags.DEFINE_string("vocab_file", None, "Copied to the export as vocab.txt.")


def main(argv):
    if len(argv) > 1:
        usage_error("export_bert", f"unexpected arguments {argv[1:]}")
    from models import bert, bert_checkpoints, bert_config, bert_export
    from tfscale.resume import checkpoints as checkpointing
    try:
        config = bert_config.BertConfig.from_json_file(FLAGS.bert_config_file)
    except (ValueError, OSError) as e:
        usage_error("export_bert", f"--bert_config_file: {e}")
    # Sequence lengths do not change the weights: any valid ones build them.
    model = bert.make_pretrainer(config, min(128, config.max_position_embeddings), 1)
    try:
        path = checkpointing.restore_model(model, FLAGS.checkpoint)
    except checkpointing.RestoreError as e:
        usage_error("export_bert", f"--checkpoint: {e}")
    bert_export.export(model, FLAGS.output_dir)
    if FLAGS.google_checkpoint:
        bert_checkpoints.save_google_checkpoint(
            model, os.path.join(FLAGS.output_dir, "bert_model.ckpt"))
    if FLAGS.vocab_file:
        shutil.copyfile(FLAGS.vocab_file,
                        os.path.join(FLAGS.output_dir, "vocab.txt"))
    print(f"exported {path} to {FLAGS.output_dir}")


def run():
    """The console script."""
    from tfscale.cli import run_main
    run_main("export_bert", main,
             required=("checkpoint", "bert_config_file", "output_dir"))


if __name__ == "__main__":
    run()
