"""ImageNet-format JPEG records and the pipeline that decodes them.

Records are the format of TF-slim's `build_imagenet_data.py`, which Model
Garden and NVIDIA's DeepLearningExamples read too:

    image/encoded                 bytes   the JPEG
    image/class/label             int64   1..1000 for ImageNet (0: background)
    image/height, image/width     int64   optional
    image/object/bbox/{ymin,xmin,ymax,xmax}  float lists in [0, 1], optional
    image/class/synset, image/class/text, image/filename, image/format, ...

Training (per image, in parallel, then batched): read the JPEG's shape from
its header, sample a crop covering part of an object box (Inception-style,
`stateless_sample_distorted_bounding_box`), decode only that crop
(`decode_and_crop_jpeg`), flip at random, resize to `image_size`. Evaluation:
decode the central `image_size / (image_size + 32)` square (again only that
window), resize. Pixels leave the pipeline as 0-255 uint8 by default and the
model standardizes them in its first layer (`benchmark_models.Standardize`):
a quarter of the bytes of float32 through batching, prefetch and the copy to
the accelerator (benchmarks/README.md, "Image pipeline").

Augmentation draws stateless seeds from (seed, the record's global
position) in the global order, so a record is cropped the same way on any
worker count; in the sharded order from (seed, worker, position in this
worker's stream). Either way every epoch crops differently, the same seed
gives the same crops, and a resumed pipeline continues exactly.
"""

import dataclasses
import random
import sys
from typing import Callable, Optional, Sequence, Tuple

import tensorflow as tf

from input_pipelines import dataset_fns, record_checks, tfrecord

OUTPUT_DTYPES = ("uint8", "float32", "bfloat16", "float16")
BBOX_KEYS = ("ymin", "xmin", "ymax", "xmax")
CROP_PADDING = 32


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What the model gets, and how training images are augmented.

    Attributes:
        image_size: Side of the square the model gets.
        num_classes: Classes of the model.
        label_offset: The records' label of the first class (1 for ImageNet
            records made by TF-slim's or Model Garden's tools and ours, where
            0 is "background"; 0 for records labelled from 0).
        output_dtype: dtype of the 0-255 pixels the model gets: "uint8"
            (default) or a float dtype. The model standardizes them.
        area_range: Crop area as a fraction of the image (Inception).
        aspect_ratio_range: Crop width / height.
        min_object_covered: Fraction of an object box the crop must hold.
        max_attempts: Crop samples before falling back to the whole image.
        flip: Random horizontal flips (training).
    """

    image_size: int = 224
    num_classes: int = 1000
    label_offset: int = 1
    output_dtype: str = "uint8"
    area_range: Tuple[float, float] = (0.08, 1.0)
    aspect_ratio_range: Tuple[float, float] = (3 / 4, 4 / 3)
    min_object_covered: float = 0.1
    max_attempts: int = 10
    flip: bool = True

    def __post_init__(self):
        if self.image_size < 8:
            raise ValueError(f"image_size must be >= 8, got {self.image_size}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if self.label_offset < 0:
            raise ValueError(f"label_offset must be >= 0, got {self.label_offset}")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, "
                             f"got {self.output_dtype!r}")
        low, high = self.area_range
        if not 0 < low <= high <= 1:
            raise ValueError(f"area_range must satisfy 0 < low <= high <= 1, "
                             f"got {self.area_range}")


# ---- records ------------------------------------------------------------------

def _bytes(value: bytes) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _ints(values) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def _floats(values) -> tf.train.Feature:
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def serialize_example(encoded: bytes, label: int, height: int, width: int,
                      *, synset: str = "", text: str = "", filename: str = "",
                      boxes: Sequence[Sequence[float]] = ()) -> bytes:
    """One image -> a serialized tf.train.Example in TF-slim's format.

    Args:
        encoded: JPEG bytes.
        label: The class label as stored (ImageNet: 1-based).
        height, width: The image's size in pixels.
        synset, text: Class directory name and human-readable name.
        filename: The image's file name.
        boxes: Object boxes as (ymin, xmin, ymax, xmax) fractions.
    """
    feature = {
        "image/encoded": _bytes(encoded),
        "image/format": _bytes(b"JPEG"),
        "image/colorspace": _bytes(b"RGB"),
        "image/channels": _ints([3]),
        "image/height": _ints([height]),
        "image/width": _ints([width]),
        "image/class/label": _ints([label]),
        "image/class/synset": _bytes(synset.encode()),
        "image/class/text": _bytes(text.encode()),
        "image/filename": _bytes(filename.encode()),
        "image/object/bbox/label": _ints([label] * len(boxes)),
    }
    for i, key in enumerate(BBOX_KEYS):
        feature[f"image/object/bbox/{key}"] = _floats([b[i] for b in boxes])
    return tf.train.Example(features=tf.train.Features(
        feature=feature)).SerializeToString(deterministic=True)


FEATURE_SPEC = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
    **{f"image/object/bbox/{key}": tf.io.VarLenFeature(tf.float32)
       for key in BBOX_KEYS},
}


def parse_record(serialized) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Serialized record -> (JPEG bytes, label as stored, boxes [1, N, 4])."""
    features = tf.io.parse_single_example(serialized, FEATURE_SPEC)
    boxes = tf.stack([tf.sparse.to_dense(features[f"image/object/bbox/{k}"])
                      for k in BBOX_KEYS], axis=-1)
    return (features["image/encoded"], features["image/class/label"],
            boxes[tf.newaxis])


# ---- per-image preprocessing ----------------------------------------------------

def crop_window(encoded, boxes, seed, spec: ImageSpec) -> tf.Tensor:
    """[y, x, height, width] of a random crop inside the JPEG's image."""
    shape = tf.image.extract_jpeg_shape(encoded)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=boxes, seed=seed,
        min_object_covered=spec.min_object_covered,
        aspect_ratio_range=spec.aspect_ratio_range,
        area_range=spec.area_range, max_attempts=spec.max_attempts,
        use_image_if_no_bounding_boxes=True)
    return tf.stack([begin[0], begin[1], size[0], size[1]])


def central_window(encoded, spec: ImageSpec) -> tf.Tensor:
    """[y, x, height, width] of the central square evaluation decodes: a
    fraction image_size / (image_size + 32) of the shorter side."""
    shape = tf.image.extract_jpeg_shape(encoded)
    height, width = shape[0], shape[1]
    side = tf.cast(
        spec.image_size / (spec.image_size + CROP_PADDING) *
        tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
    return tf.stack([(height - side + 1) // 2, (width - side + 1) // 2,
                     side, side])


def finish(image, spec: ImageSpec) -> tf.Tensor:
    """A float32 [S, S, 3] image in 0-255 -> the output dtype (0-255)."""
    if spec.output_dtype == "uint8":
        # Bilinear resizing of uint8 pixels stays in [0, 255]: round, cast.
        return tf.cast(image + 0.5, tf.uint8)
    return tf.cast(image, spec.output_dtype)


def train_image(encoded, boxes, seed, spec: ImageSpec) -> tf.Tensor:
    """Random crop (only it is decoded), random flip (of the uint8 crop:
    fewer bytes than the resized float image), resize."""
    crop_seed, flip_seed = tf.unstack(
        tf.random.experimental.stateless_split(seed, 2))
    window = crop_window(encoded, boxes, crop_seed, spec)
    image = tf.image.decode_and_crop_jpeg(encoded, window, channels=3)
    if spec.flip:
        image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    image = tf.image.resize(image, [spec.image_size, spec.image_size])
    return finish(image, spec)


def eval_image(encoded, spec: ImageSpec) -> tf.Tensor:
    """Central crop (only it is decoded), resize."""
    image = tf.image.decode_and_crop_jpeg(
        encoded, central_window(encoded, spec), channels=3)
    image = tf.image.resize(image, [spec.image_size, spec.image_size])
    return finish(image, spec)


def checked_label(label, spec: ImageSpec) -> tf.Tensor:
    """Stored label -> class index in [0, num_classes), int32; fails naming
    the label and the flags when it is out of range."""
    index = label - spec.label_offset
    check = tf.debugging.Assert(
        tf.logical_and(index >= 0, index < spec.num_classes),
        [f"image/class/label outside [{spec.label_offset}, "
         f"{spec.label_offset + spec.num_classes}) (--label_offset="
         f"{spec.label_offset}, --num_classes={spec.num_classes}); label:",
         label], summarize=1)
    with tf.control_dependencies([check]):
        return tf.cast(index, tf.int32)


def make_example_fn(spec: ImageSpec, training: bool,
                    seed=None, stream: Optional[int] = None,
                    by_record: bool = False) -> Callable:
    """`fn(index, serialized) -> (image, label)` for one input pipeline.

    Args:
        spec: Output and augmentation.
        training: Random crop and flip (else the central crop).
        seed: Seed of the augmentation (an int or an int64 scalar tensor);
            None: a random one.
        stream: None when `index` is a global position (the global order:
            the same crops on any worker count); else this pipeline's index,
            so that workers crop differently.
        by_record: Also mix a hash of the record into its seed: tf.data
            service workers all run one graph and count from 0 alike.
    """
    if seed is None:
        seed = random.SystemRandom().getrandbits(31)
    base = tf.cast(seed, tf.int64)
    if stream is not None:
        base = base * 1_000_003 + stream

    def example_fn(index, serialized):
        encoded, label, boxes = parse_record(serialized)
        if training:
            key = base
            if by_record:
                key = tf.bitwise.bitwise_xor(key, tf.strings.to_hash_bucket_fast(
                    serialized, 1 << 62))
            image = train_image(encoded, boxes, tf.stack([key, index]), spec)
        else:
            image = eval_image(encoded, spec)
        return image, checked_label(label, spec)
    return example_fn


def make_dataset(records: tfrecord.TFRecordConfig, spec: ImageSpec,
                 batch_size: int,
                 input_context: Optional[tf.distribute.InputContext] = None,
                 num_parallel_calls: Optional[int] = tfrecord.AUTOTUNE,
                 start_position: int = 0) -> tf.data.Dataset:
    """Batches of (image [B, S, S, 3], class index [B]) of one pipeline."""
    stream = input_context.input_pipeline_id if input_context else 0
    seed = records.seed
    if tfrecord.uses_global_order(records):
        stream = None
        seed = tfrecord.DEFAULT_ORDER_SEED if seed is None else seed
    example_fn = make_example_fn(spec, records.training, seed, stream,
                                 by_record=records.service is not None)
    return tfrecord.make_example_dataset(
        records, batch_size, example_fn, input_context,
        num_parallel_calls=num_parallel_calls,
        on_skipped=_report_skipped(stream or 0),
        start_position=start_position)


def _report_skipped(stream: int) -> Callable:
    def on_skipped(count):
        return tf.print(f"tfscale: input pipeline {stream}: skipped a corrupt "
                        "record (--skip_corrupt_records);", count,
                        "so far", output_stream=sys.stderr)
    return on_skipped


def make_dataset_fn(records: tfrecord.TFRecordConfig, spec: ImageSpec,
                    per_replica_batch_size: int) -> Callable:
    """`fn(InputContext) -> dataset` of per-replica image batches
    (`dataset_fns.DatasetFn`; in the global order it can start anywhere)."""
    def build(config, input_context, start_position):
        return make_dataset(config, spec, per_replica_batch_size,
                            input_context, start_position=start_position)
    return dataset_fns.make_dataset_fn(records, build)


# ---- diagnosis ------------------------------------------------------------------

def describe_record(record: bytes, spec: ImageSpec) -> Optional[str]:
    """What is wrong with one serialized record, or None."""
    try:
        example = tf.train.Example.FromString(record)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        return "not a tf.train.Example"
    features = example.features.feature
    for name in ("image/encoded", "image/class/label"):
        if name not in features:
            return (f"no feature {name!r} (has {sorted(features)}); not an "
                    "ImageNet-format image record?")
    label = list(features["image/class/label"].int64_list.value)
    if len(label) != 1:
        return f"image/class/label has {len(label)} values, expected 1"
    index = label[0] - spec.label_offset
    if not 0 <= index < spec.num_classes:
        return (f"image/class/label {label[0]} is outside "
                f"[{spec.label_offset}, {spec.label_offset + spec.num_classes})"
                f" (--label_offset={spec.label_offset}, --num_classes="
                f"{spec.num_classes})")
    encoded = features["image/encoded"].bytes_list.value[0]
    try:
        tf.io.decode_jpeg(encoded, channels=3, ratio=8)
    except tf.errors.InvalidArgumentError as e:
        return f"image/encoded is not a readable JPEG ({record_checks.op_message(e)})"
    return None


def check_first_record(files, spec: ImageSpec,
                       compression_type: Optional[str] = None) -> None:
    """Checks one record of the first file: a BERT record, or labels for
    another --num_classes, fail here, before training.

    Raises:
        record_files.InputError: "FILE: record 0: <problem>".
    """
    record_checks.check_first_record(
        files, lambda record: describe_record(record, spec), compression_type)


def find_bad_record(files, spec: ImageSpec,
                    compression_type: Optional[str] = None) -> Optional[str]:
    """"FILE: record N: <problem>" of the first bad record in `files`, or
    None. Decodes every JPEG at 1/8 scale (several times faster than a
    full decode); run after the pipeline failed."""
    def check_batch(batch):
        for record in batch.numpy():
            if describe_record(record, spec):
                raise tf.errors.InvalidArgumentError(None, None, "bad record")
    return record_checks.find_bad_record(
        files, check_batch, compression_type,
        describe=lambda record: describe_record(record, spec))
