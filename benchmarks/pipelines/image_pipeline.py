r"""Images/s of the ImageNet training pipeline vs its ceiling, a naive
pipeline, Model Garden's, and one knob at a time.

    python -m benchmarks.pipelines.image_pipeline --output_dir runs/image_pipeline

Makes patterned JPEGs at ImageNet's sizes (300-500 px, quality 90) and
writes them as ImageNet-format records (nothing is downloaded), then times,
in one process and interleaved over --repeats rounds (the median is kept):

  ceiling        decode of the training crop (`decode_and_crop_jpeg`,
                 windows sampled beforehand, JPEGs in memory) and its resize
                 to the output size, on all cores: the work no pipeline can
                 skip (decode_only: the decode alone)
  tfscale        `images.make_dataset`, the training pipeline as shipped
  naive          full decode, then crop, resize, flip, standardize, float32,
                 one image at a time (sequential map, no prefetch, and
                 tf.data's map_parallelization off: it would otherwise
                 run the map in parallel)
  model_garden   Model Garden's classification input (Decoder + Parser, its
                 AUTOTUNE map, batch, prefetch), when it can be imported
  and variants of tfscale with one knob changed (see VARIANTS).

Model Garden is installed only for this benchmark, into
--model_garden_dir, with `pip install --no-deps tf-models-official` plus the
modules it imports at load time (pyyaml, gin-config, scipy, pycocotools,
opencv-python-headless); --no_model_garden skips it.
"""

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys

import tensorflow as tf

from benchmarks import harness
from benchmarks.pipelines.input_pipeline import examples_per_second
from input_pipelines import image_folder, images, pattern_images, tfrecord

MODEL_GARDEN_PACKAGES = ("tf-models-official==2.20.0", "pyyaml", "gin-config",
                         "scipy", "pycocotools", "opencv-python-headless")
MEAN_RGB = (123.675, 116.28, 103.53)
STDDEV_RGB = (58.395, 57.12, 57.375)

# variant -> (what it changes, keyword arguments of `tfscale_pipeline`)
VARIANTS = {
    "tfscale": ("as shipped: global record order, AUTOTUNE map, uint8 out",
                {}),
    "sharded_order": ("--input_order=sharded: files dealt out per worker, "
                      "interleave, shuffle buffer of 1,024 records",
                      dict(order="sharded")),
    "autotune_off": ("tf.data's autotune model off (AUTOTUNE map = the "
                     "cores)", dict(options=dict(autotune=False))),
    "map_parallel_2": ("num_parallel_calls = 2 (the cores) instead of "
                       "AUTOTUNE", dict(num_parallel_calls=2)),
    "map_sequential": ("num_parallel_calls = None, tf.data's "
                       "map_parallelization off (truly one at a time)",
                       dict(num_parallel_calls=None,
                            options=dict(map_parallelization=False))),
    "no_map_and_batch_fusion": ("tf.data's map_and_batch_fusion off",
                                dict(options=dict(map_and_batch_fusion=False))),
    "no_default_optimizations": ("experimental_optimization."
                                 "apply_default_optimizations = False",
                                 dict(options=dict(no_defaults=True))),
    "private_threadpool_2": ("threading.private_threadpool_size = 2",
                             dict(options=dict(threadpool=2))),
    "intra_op_1": ("threading.max_intra_op_parallelism = 1",
                   dict(options=dict(intra_op=1))),
    "float32_out": ("float32 pixels out (0-255) instead of uint8",
                    dict(output_dtype="float32")),
    "standardized_float32": ("standardize + float32 in the pipeline (not in "
                             "the model)", dict(standardize=True)),
    "full_decode_then_crop": ("decode the whole JPEG, then crop (parallel)",
                              dict(full_decode=True)),
    "flip_after_resize": ("flip the resized uint8 image instead of the "
                          "decoded crop (fewer bytes)", dict(flip_last=True)),
}


def make_records(output_dir: str, num_classes: int, per_class: int) -> str:
    """JPEG folder -> records, once; returns the records' glob."""
    records = os.path.join(output_dir, "records")
    if not tf.io.gfile.glob(os.path.join(records, "train-*")):
        folder = os.path.join(output_dir, "images")
        pattern_images.write_image_folder(folder, num_classes, per_class)
        image_folder.write_records(image_folder.WriterConfig(
            image_dir=folder, output_dir=records, num_shards=8))
    return os.path.join(records, "train-*")


def _options(no_defaults=False, map_and_batch_fusion=None, threadpool=None,
             intra_op=None, map_parallelization=None,
             autotune=None) -> tf.data.Options:
    options = tf.data.Options()
    if autotune is not None:
        options.autotune.enabled = autotune
    if map_parallelization is not None:
        # On by default: tf.data runs a "sequential" stateless map in
        # parallel anyway.
        options.experimental_optimization.map_parallelization = (
            map_parallelization)
    if no_defaults:
        options.experimental_optimization.apply_default_optimizations = False
    if map_and_batch_fusion is not None:
        options.experimental_optimization.map_and_batch_fusion = (
            map_and_batch_fusion)
    if threadpool:
        options.threading.private_threadpool_size = threadpool
    if intra_op:
        options.threading.max_intra_op_parallelism = intra_op
    return options


def _standardize(image):
    return (image - tf.constant(MEAN_RGB)) / tf.constant(STDDEV_RGB)


def tfscale_pipeline(files, spec, batch_size, num_parallel_calls=tfrecord.AUTOTUNE,
                     options=None, output_dtype=None, standardize=False,
                     full_decode=False, order="global", flip_last=False):
    """The shipped pipeline, or it with one knob changed."""
    records = tfrecord.TFRecordConfig(files, training=True, seed=1,
                                      shuffle_buffer_size=1024, order=order)
    if output_dtype or standardize:
        spec = dataclasses.replace(spec,
                                   output_dtype=output_dtype or "float32")
    if not (standardize or full_decode or flip_last):
        ds = images.make_dataset(records, spec, batch_size,
                                 num_parallel_calls=num_parallel_calls)
    else:
        example_fn = images.make_example_fn(spec, True, seed=1)

        def variant_fn(index, serialized):
            if full_decode:
                return _naive_example(serialized, spec, index)
            if flip_last:
                return _flip_last_example(serialized, spec, index)
            image, label = example_fn(index, serialized)
            return _standardize(image), label
        ds = tfrecord.make_example_dataset(records, batch_size, variant_fn,
                                           num_parallel_calls=num_parallel_calls)
    return ds.with_options(_options(**(options or {})))


def _naive_example(serialized, spec, index):
    """Decode everything, then crop: what the fused op avoids."""
    encoded, label, boxes = images.parse_record(serialized)
    image = tf.io.decode_jpeg(encoded, channels=3)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), boxes, seed=tf.stack([tf.constant(1, tf.int64), index]),
        min_object_covered=spec.min_object_covered,
        aspect_ratio_range=spec.aspect_ratio_range,
        area_range=spec.area_range, max_attempts=spec.max_attempts,
        use_image_if_no_bounding_boxes=True)
    image = tf.slice(image, begin, size)
    image = tf.image.resize(image, [spec.image_size, spec.image_size])
    image = tf.image.stateless_random_flip_left_right(
        image, tf.stack([tf.constant(2, tf.int64), index]))
    return _standardize(image), tf.cast(label - spec.label_offset, tf.int32)


def _flip_last_example(serialized, spec, index):
    """The shipped example with the flip after the resize."""
    encoded, label, boxes = images.parse_record(serialized)
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(
        tf.stack([tf.constant(1, tf.int64), index]), 2))
    window = images.crop_window(encoded, boxes, crop_seed, spec)
    image = tf.image.decode_and_crop_jpeg(encoded, window, channels=3)
    image = tf.image.resize(image, [spec.image_size, spec.image_size])
    image = tf.image.stateless_random_flip_left_right(
        images.finish(image, spec), flip_seed)
    return image, images.checked_label(label, spec)


def naive_pipeline(files, spec, batch_size):
    ds = tf.data.TFRecordDataset(tf.io.gfile.glob(files)).shuffle(1024, seed=1)
    ds = ds.repeat().enumerate()
    ds = ds.map(lambda i, r: _naive_example(r, spec, i))
    return ds.batch(batch_size, drop_remainder=True).with_options(
        _options(map_parallelization=False))


def ceiling_pipeline(files, spec, batch_size, resize=True):
    """Decode of the training crops and their resize to the output size
    (the work no pipeline can skip), JPEGs and windows in memory;
    `resize=False`: the decode alone."""
    encoded, windows = [], []
    for index, record in enumerate(tf.data.TFRecordDataset(
            tf.io.gfile.glob(files))):
        jpeg, _, boxes = images.parse_record(record)
        encoded.append(jpeg)
        windows.append(images.crop_window(
            jpeg, boxes, tf.constant([1, index], tf.int64), spec))
    ds = tf.data.Dataset.from_tensor_slices((tf.stack(encoded),
                                             tf.stack(windows)))
    def work(jpeg, window):
        image = tf.image.decode_and_crop_jpeg(jpeg, window, channels=3)
        if resize:
            return tf.image.resize(image, [spec.image_size, spec.image_size])
        return tf.shape(image)[0]
    ds = ds.repeat().map(work, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def model_garden_pipeline(files, spec, batch_size):
    from official.vision.dataloaders import classification_input
    decoder = classification_input.Decoder()
    parser = classification_input.Parser(
        output_size=[spec.image_size, spec.image_size],
        num_classes=spec.num_classes)
    parse = parser.parse_fn(is_training=True)
    names = tf.io.gfile.glob(files)
    ds = tf.data.Dataset.from_tensor_slices(names).shuffle(len(names), seed=1)
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=2,
                       num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.shuffle(1024, seed=1).repeat()
    ds = ds.map(lambda r: parse(decoder.decode(r)),
                num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def ensure_model_garden(directory: str) -> str:
    """Installs tf-models-official (no deps) into `directory`, once; makes it
    importable; returns "" or why it cannot be used."""
    if not os.path.isdir(os.path.join(directory, "official")):
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
             "--target", directory, *MODEL_GARDEN_PACKAGES],
            capture_output=True, text=True)
        if result.returncode:
            return "pip install failed: " + result.stderr.strip()[-300:]
    sys.path.insert(0, directory)
    try:
        from official.vision.dataloaders import classification_input  # noqa
    except Exception as e:  # noqa: BLE001 - any import-time failure
        return f"import failed on TF {tf.__version__}: {e!r}"
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", default="runs/image_pipeline",
                   help="folder for report.md and results.json")
    p.add_argument("--image_size", type=int, default=224,
                   help="image side in pixels")
    p.add_argument("--batch_size", type=int, default=32,
                   help="examples a batch")
    p.add_argument("--batches", type=int, default=30,
                   help="batches timed")
    p.add_argument("--warmup_batches", type=int, default=5,
                   help="batches read first, untimed")
    p.add_argument("--repeats", type=int, default=3,
                   help="times each measurement is repeated")
    p.add_argument("--num_classes", type=int, default=10,
                   help="classes of the synthetic images")
    p.add_argument("--images_per_class", type=int, default=64,
                   help="synthetic images a class")
    p.add_argument("--variants", default="all",
                   help="comma list of " + ", ".join(
                       ["ceiling", "decode_only", "naive", "model_garden",
                       *VARIANTS]))
    p.add_argument("--model_garden_dir", default="runs/model_garden",
                   help="a checkout of TF Model Garden (fetched there if "
                        "missing), for its pipeline as the baseline")
    p.add_argument("--no_model_garden", action="store_true",
                   help="skip the Model Garden baseline")
    args = p.parse_args(argv)

    files = make_records(args.output_dir, args.num_classes,
                         args.images_per_class)
    spec = images.ImageSpec(image_size=args.image_size,
                            num_classes=args.num_classes)
    builders = {"ceiling": lambda: ceiling_pipeline(files, spec,
                                                    args.batch_size),
                "decode_only": lambda: ceiling_pipeline(
                    files, spec, args.batch_size, resize=False),
                "naive": lambda: naive_pipeline(files, spec, args.batch_size)}
    for name, (_, kwargs) in VARIANTS.items():
        builders[name] = (lambda kw=kwargs: tfscale_pipeline(
            files, spec, args.batch_size, **kw))
    garden_note = "skipped (--no_model_garden)"
    if not args.no_model_garden:
        garden_note = ensure_model_garden(os.path.abspath(
            args.model_garden_dir))
        if not garden_note:
            builders["model_garden"] = lambda: model_garden_pipeline(
                files, spec, args.batch_size)
    names = list(builders) if args.variants == "all" else [
        v.strip() for v in args.variants.split(",")]
    rates = {name: [] for name in names}
    for round_ in range(args.repeats):
        for name in names:
            batches = args.batches // 4 if name == "naive" else args.batches
            rate = examples_per_second(
                builders[name](), args.batch_size,
                warmup=args.warmup_batches, batches=max(2, batches))
            rates[name].append(rate)
            print(f"round {round_ + 1}: {name}: {rate:.1f} images/s",
                  flush=True)
    table = report(rates, args, garden_note)
    print(table)
    with open(os.path.join(args.output_dir, "image_pipeline.md"), "w") as f:
        f.write(table + "\n")


def report(rates, args, garden_note) -> str:
    median = {name: statistics.median(values) for name, values in
              rates.items()}
    ceiling = median.get("ceiling")
    tfscale = median.get("tfscale")
    lines = [f"Image pipeline, {args.image_size} px, batch {args.batch_size}, "
             f"{os.cpu_count()} cores, median of {args.repeats} rounds "
             f"(images/s)", ""]
    what = {"ceiling": "decode of the crop + resize to the output size, "
                       "in memory, all cores",
            "decode_only": "decode of the crop alone (the old ceiling)",
            "naive": "full decode, crop, standardize; one at a time, no "
                     "prefetch",
            "model_garden": "Model Garden classification_input (float32 out)",
            **{k: v[0] for k, v in VARIANTS.items()}}
    lines.append(harness.table(
        ["pipeline", "what changes", "images/s", "vs ceiling", "vs tfscale"],
        ([name, what[name], f"{value:.1f}",
          f"{value / ceiling:.2f}" if ceiling else "-",
          f"{value / tfscale:.2f}" if tfscale else "-"]
         for name, value in median.items()), align="llrrr"))
    if "model_garden" not in median:
        lines += ["", f"Model Garden: {garden_note}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
