r"""A folder of patterned JPEGs in ImageNet's train layout, then records.

    python -m input_pipelines.make_demo_images --output_dir=runs/images \
        --num_classes=10 --images_per_class=100

Writes OUTPUT_DIR/images/class_XXX/*.jpg (see `pattern_images`) and turns
them into OUTPUT_DIR/records/{train,validation}-*-of-* with
`build_image_records`'s writer (labels from 1, as ImageNet's).
"""

import os

from absl import app, flags

from input_pipelines import image_folder, pattern_images

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", "runs/images", "Where to write.")
flags.DEFINE_integer("num_classes", 10, "Classes.")
flags.DEFINE_integer("images_per_class", 100, "Training images per class.")
flags.DEFINE_integer("eval_images_per_class", 10, "Validation images per "
                     "class.")
flags.DEFINE_integer("num_shards", 8, "Training record files.")
flags.DEFINE_integer("seed", 0, "Seed of the images.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    for name, count, seed, shards in (
            ("train", FLAGS.images_per_class, FLAGS.seed, FLAGS.num_shards),
            ("validation", FLAGS.eval_images_per_class, FLAGS.seed + 1, 2)):
        folder = os.path.join(FLAGS.output_dir, "images", name)
        pattern_images.write_image_folder(folder, FLAGS.num_classes, count,
                                          seed=seed)
        files = image_folder.write_records(image_folder.WriterConfig(
            image_dir=folder, output_dir=os.path.join(FLAGS.output_dir,
                                                      "records"),
            name=name, num_shards=shards))
        print(f"make_demo_images: {FLAGS.num_classes} x {count} {name} "
              f"images in {folder}, {len(files)} record files")


if __name__ == "__main__":
    from tfscale.cli import list_flags_in_help
    list_flags_in_help()
    app.run(main)
