r"""A folder of images -> sharded, shuffled ImageNet-format TFRecords.

    python -m input_pipelines.build_image_records \
        --image_dir=ILSVRC2012/train --output_dir=records --name=train \
        --num_shards=1024 [--labels_file=synsets.txt] \
        [--metadata_file=imagenet_metadata.txt] [--bounding_box_file=boxes.csv]
    python -m input_pipelines.build_image_records \
        --image_dir=ILSVRC2012/val --output_dir=records --name=validation \
        --num_shards=128 --labels_file=records/labels.txt \
        --image_labels_file=imagenet_2012_validation_synset_labels.txt

`image_dir` holds one folder per class (`n01440764/xxx.JPEG`, the layout of
ImageNet's train set), or, with `--image_labels_file` (one class per image,
in the sorted order of the file names), it is flat like ImageNet's
validation set. Classes are numbered in the order of `--labels_file` (one
class name per line, e.g. TF-slim's imagenet_lsvrc_2015_synsets.txt, or the
labels.txt written with the training records) or else sorted, from
`--label_offset`
(1: TF-slim's convention, 0 is "background"). Writes
`NAME-00000-of-0NNNN` files (TF-slim's names, the format of `images.py`)
and `labels.txt` (line i: the folder name of label i + offset). Images that
are not JPEG (PNG, GIF, BMP) are re-encoded as JPEG; an unreadable image is
a one-line error naming it. A shard appears under its name only when
complete. Writer processes (one per core) write shards in parallel, with a
progress bar (images, rate, ETA); a rerun of the same command after a
crash keeps the complete shards and writes only the missing ones, the same
bytes as an uninterrupted run.
"""

import os
from typing import Sequence

from absl import app, flags

from input_pipelines.prepare import engine

FLAGS = flags.FLAGS
flags.DEFINE_string("image_dir", None, "One folder of images per class.")
flags.DEFINE_string("output_dir", None, "Where to write the records.")
flags.DEFINE_string("name", "train", "Record file prefix (train, validation).")
flags.DEFINE_integer("num_shards", 16, "Record files to write.")
flags.DEFINE_integer("label_offset", 1, "Label of the first class (1: "
                     "TF-slim/ImageNet, 0 is background).")
flags.DEFINE_string("labels_file", None, "Class names in label order.")
flags.DEFINE_string("image_labels_file", None,
                    "One class name per image of a flat --image_dir, in the "
                    "sorted order of the file names (ImageNet's validation "
                    "synset labels).")
flags.DEFINE_string("metadata_file", None, "synset<TAB>text lines.")
flags.DEFINE_string("bounding_box_file", None,
                    "file,xmin,ymin,xmax,ymax lines (fractions).")
flags.DEFINE_integer("seed", 12345, "Shuffle seed.")
flags.DEFINE_integer("num_processes", 0, "Writer processes (0: one per "
                     "core; fewer for small jobs).")
flags.DEFINE_bool("progress", True, "Show a progress bar (images, rate, "
                  "ETA) on stderr.")
engine.define_flags(flags)


def main(argv: Sequence[str]):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from tfscale.cli import quiet_tensorflow
    quiet_tensorflow(FLAGS.verbosity)
    import tensorflow as tf

    from input_pipelines.image_folder import WriterConfig, build
    try:
        config = WriterConfig(
            image_dir=FLAGS.image_dir, output_dir=FLAGS.output_dir,
            name=FLAGS.name, num_shards=FLAGS.num_shards,
            label_offset=FLAGS.label_offset, labels_file=FLAGS.labels_file,
            image_labels_file=FLAGS.image_labels_file,
            metadata_file=FLAGS.metadata_file,
            bounding_box_file=FLAGS.bounding_box_file, seed=FLAGS.seed,
            num_processes=FLAGS.num_processes,
            scheduler=FLAGS.scheduler, scheduler_file=FLAGS.scheduler_file,
            worker_memory=FLAGS.worker_memory)
        result = build(config, show_progress=FLAGS.progress)
    except (ValueError, tf.errors.NotFoundError, engine.TaskError) as e:
        message = getattr(e, "message", None) or str(e)
        raise SystemExit(f"build_image_records: error: {message}") from None
    kept = (f"; kept {result.shards_kept} complete shards "
            f"({result.images_kept} images) of an earlier run"
            if result.shards_kept else "")
    if result.leftovers_removed:
        kept += (f"; removed {result.leftovers_removed} temporary file(s) "
                 "of attempts that died")
    print(f"build_image_records: wrote {result.images_written} images in "
          f"{result.seconds:.1f} s ({result.images_per_second:.1f} images/s)"
          f"{kept}: {len(result.names)} files in {FLAGS.output_dir} "
          f"({FLAGS.name}-*), labels in "
          f"{os.path.join(FLAGS.output_dir, 'labels.txt')}")


def run():
    """The console script."""
    from tfscale.cli import run_main
    run_main("build_image_records", main, required=("image_dir", "output_dir"))


if __name__ == "__main__":
    run()
