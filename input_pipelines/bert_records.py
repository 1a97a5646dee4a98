"""BERT pretraining records in Google's `create_pretraining_data.py` format.

Features (fixed length, int64 unless noted):
    input_ids, input_mask, segment_ids        [max_seq_length]
    masked_lm_positions, masked_lm_ids         [max_predictions_per_seq]
    masked_lm_weights (float32)                [max_predictions_per_seq]
    next_sentence_labels                       [1]   (1: B is a random sentence)

Records written by Google's tool, NVIDIA's, or ours are interchangeable.
"""

import dataclasses
from typing import Callable

import tensorflow as tf

from input_pipelines import tfrecord

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


def to_model_inputs(features: dict):
    """Parsed batch -> (inputs, labels), ints as int32 (as Google's reader)."""
    cast = {k: tf.cast(v, tf.int32) if v.dtype == tf.int64 else v
            for k, v in features.items()}
    inputs = {k: cast[k] for k in MODEL_INPUTS}
    labels = {k: cast[k] for k in LABELS}
    return inputs, labels


def make_parse_fn(spec: BertRecordSpec):
    return tfrecord.make_parse_fn(feature_spec(spec), to_model_inputs)


def make_dataset_fn(records: tfrecord.TFRecordConfig, spec: BertRecordSpec,
                    per_replica_batch_size: int) -> Callable:
    """`fn(InputContext) -> dataset` of per-replica BERT batches."""
    parse = make_parse_fn(spec)
    # Fail now, on the host, naming the pattern, rather than inside tf.data.
    tfrecord.expand_files(records.input_files)

    def dataset_fn(input_context=None):
        return tfrecord.make_dataset(records, per_replica_batch_size, parse,
                                     input_context)
    return dataset_fn


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
        feature=features)).SerializeToString()
