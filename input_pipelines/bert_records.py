"""BERT pretraining records in Google's `create_pretraining_data.py` format.

Features (fixed length, int64 unless noted):
    input_ids, input_mask, segment_ids        [max_seq_length]
    masked_lm_positions, masked_lm_ids         [max_predictions_per_seq]
    masked_lm_weights (float32)                [max_predictions_per_seq]
    next_sentence_labels                       [1]   (1: B is a random sentence)

Records written by Google's tool, NVIDIA's, or ours are interchangeable.
"""

import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from input_pipelines import dataset_fns, record_checks, tfrecord

FEATURE_NAMES = ("input_ids", "input_mask", "segment_ids",
                 "masked_lm_positions", "masked_lm_ids", "masked_lm_weights",
                 "next_sentence_labels")
MODEL_INPUTS = ("input_ids", "input_mask", "segment_ids",
                "masked_lm_positions")
LABELS = ("masked_lm_ids", "masked_lm_weights", "next_sentence_labels")


@dataclasses.dataclass(frozen=True)
class BertRecordSpec:
    """The two lengths that fix a BERT record's shape."""

    max_seq_length: int = 128
    max_predictions_per_seq: int = 20

    def __post_init__(self):
        if self.max_seq_length < 8 or self.max_predictions_per_seq < 1:
            raise ValueError("max_seq_length must be >= 8 and "
                             "max_predictions_per_seq >= 1")
        if self.max_predictions_per_seq > self.max_seq_length:
            raise ValueError("max_predictions_per_seq cannot exceed "
                             "max_seq_length")


def feature_spec(spec: BertRecordSpec) -> dict:
    seq, pred = spec.max_seq_length, spec.max_predictions_per_seq
    return {
        "input_ids": tf.io.FixedLenFeature([seq], tf.int64),
        "input_mask": tf.io.FixedLenFeature([seq], tf.int64),
        "segment_ids": tf.io.FixedLenFeature([seq], tf.int64),
        "masked_lm_positions": tf.io.FixedLenFeature([pred], tf.int64),
        "masked_lm_ids": tf.io.FixedLenFeature([pred], tf.int64),
        "masked_lm_weights": tf.io.FixedLenFeature([pred], tf.float32),
        "next_sentence_labels": tf.io.FixedLenFeature([1], tf.int64),
    }


# The flag (and spec field) that fixes each feature's length.
LENGTH_FLAG_OF = {"input_ids": "max_seq_length", "input_mask": "max_seq_length",
                "segment_ids": "max_seq_length",
                "masked_lm_positions": "max_predictions_per_seq",
                "masked_lm_ids": "max_predictions_per_seq",
                "masked_lm_weights": "max_predictions_per_seq"}


@dataclasses.dataclass(frozen=True)
class IdLimits:
    """Exclusive upper bounds of the records' ids, from the model's config.

    An id out of range fails on a CPU but, on a GPU, an embedding lookup
    returns zeros and training goes on silently, so the pipeline checks.
    """

    vocab_size: int
    type_vocab_size: int


def _bounds(spec: BertRecordSpec, limits: IdLimits) -> dict:
    """feature -> (exclusive bound, what sets it)."""
    return {"input_ids": (limits.vocab_size, "the model's vocab_size"),
            "masked_lm_ids": (limits.vocab_size, "the model's vocab_size"),
            "segment_ids": (limits.type_vocab_size,
                            "the model's type_vocab_size"),
            "masked_lm_positions": (spec.max_seq_length,
                                    "--max_seq_length")}


def to_model_inputs(features: dict, spec: Optional[BertRecordSpec] = None,
                    limits: Optional[IdLimits] = None):
    """Parsed batch -> (inputs, labels), ints as int32 (as Google's reader).

    With `limits`, fails (tf.errors.InvalidArgumentError naming the feature)
    if any id is negative or out of range: one max and one min per feature
    per parsed chunk, next to nothing beside the parse.
    """
    if limits is not None:
        checks = []
        for name, (bound, source) in _bounds(spec, limits).items():
            values = features[name]
            checks.append(tf.debugging.Assert(
                tf.logical_and(tf.reduce_max(values) < bound,
                               tf.reduce_min(values) >= 0),
                [f"{name} holds ids outside [0, {bound}) ({source}); "
                 "largest:", tf.reduce_max(values)], summarize=1))
        with tf.control_dependencies(checks):
            features = {k: tf.identity(v) for k, v in features.items()}
    cast = {k: tf.cast(v, tf.int32) if v.dtype == tf.int64 else v
            for k, v in features.items()}
    inputs = {k: cast[k] for k in MODEL_INPUTS}
    labels = {k: cast[k] for k in LABELS}
    return inputs, labels


def make_parse_fn(spec: BertRecordSpec, limits: Optional[IdLimits] = None):
    return tfrecord.make_parse_fn(
        feature_spec(spec), lambda f: to_model_inputs(f, spec, limits))


def describe_record(record: bytes, spec: BertRecordSpec,
                    limits: Optional[IdLimits] = None) -> Optional[str]:
    """What is wrong with one serialized record, in the user's terms (which
    feature has how many values, which flag expects how many), or None."""
    try:
        example = tf.train.Example.FromString(record)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        return "not a tf.train.Example"
    features = example.features.feature
    expected = feature_spec(spec)
    for name, feature_def in expected.items():
        if name not in features:
            return (f"no feature {name!r} (has {sorted(features)}); not a "
                    "BERT pretraining record?")
        kind = "float_list" if feature_def.dtype == tf.float32 else "int64_list"
        values = getattr(features[name], kind).value
        if len(values) != feature_def.shape[0]:
            if features[name].WhichOneof("kind") != kind:
                return (f"feature {name!r} is a "
                        f"{features[name].WhichOneof('kind')}, expected {kind}")
            flag = LENGTH_FLAG_OF.get(name)
            wanted = (f"--{flag}={getattr(spec, flag)} expects "
                      f"{feature_def.shape[0]}" if flag else
                      f"expected {feature_def.shape[0]}")
            return (f"{name} has {len(values)} values per record, but "
                    f"{wanted} (records written for another {flag or 'spec'}?)")
    if limits is not None:
        for name, (bound, source) in _bounds(spec, limits).items():
            values = features[name].int64_list.value
            if values and (max(values) >= bound or min(values) < 0):
                bad = max(values) if max(values) >= bound else min(values)
                return (f"{name} holds id {bad}, outside [0, {bound}) of "
                        f"{source} (records made with another vocabulary or "
                        "--bert_config_file?)")
    return None


def check_first_record(files, spec: BertRecordSpec,
                       limits: Optional[IdLimits] = None,
                       compression_type: Optional[str] = None) -> None:
    """Checks one record of the first file against the spec and the model:
    a wrong length or vocabulary fails here, before training.

    Raises:
        record_files.InputError: "FILE: record 0: <problem>".
    """
    record_checks.check_first_record(
        files, lambda record: describe_record(record, spec, limits),
        compression_type)


def find_bad_record(files, spec: BertRecordSpec,
                    limits: Optional[IdLimits] = None,
                    compression_type: Optional[str] = None) -> Optional[str]:
    """`record_checks.find_bad_record` with BERT's parse and its descriptions."""
    return record_checks.find_bad_record(
        files, make_parse_fn(spec, limits), compression_type,
        describe=lambda record: describe_record(record, spec, limits))


def make_dataset_fn(records: tfrecord.TFRecordConfig, spec: BertRecordSpec,
                    per_replica_batch_size: int,
                    limits: Optional[IdLimits] = None) -> Callable:
    """`fn(InputContext) -> dataset` of per-replica BERT batches
    (`dataset_fns.DatasetFn`; in the global order it can start anywhere)."""
    parse = make_parse_fn(spec, limits)

    def build(config, input_context, start_position):
        return tfrecord.make_dataset(config, per_replica_batch_size, parse,
                                     input_context, start_position)
    return dataset_fns.make_dataset_fn(records, build)


def serialize_instance(input_ids, segment_ids, masked_lm_positions,
                       masked_lm_ids, is_random_next: bool,
                       spec: BertRecordSpec) -> bytes:
    """One training instance -> a serialized tf.train.Example, padded."""
    seq, pred = spec.max_seq_length, spec.max_predictions_per_seq
    if len(input_ids) > seq or len(masked_lm_ids) > pred:
        raise ValueError("instance longer than the record spec")
    pad = seq - len(input_ids)
    mpad = pred - len(masked_lm_ids)

    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    features = {
        "input_ids": ints(list(input_ids) + [0] * pad),
        "input_mask": ints([1] * len(input_ids) + [0] * pad),
        "segment_ids": ints(list(segment_ids) + [0] * pad),
        "masked_lm_positions": ints(list(masked_lm_positions) + [0] * mpad),
        "masked_lm_ids": ints(list(masked_lm_ids) + [0] * mpad),
        "masked_lm_weights": tf.train.Feature(float_list=tf.train.FloatList(
            value=[1.0] * len(masked_lm_ids) + [0.0] * mpad)),
        "next_sentence_labels": ints([1 if is_random_next else 0]),
    }
    return tf.train.Example(features=tf.train.Features(
        feature=features)).SerializeToString(deterministic=True)
