"""Checks of records against what a model expects, on the host: the first
record before training, and, after the pipeline fails, a scan that names
the file, the record and the cause (TensorFlow's errors name neither)."""

import re
from typing import Callable, Optional, Sequence

import tensorflow as tf

from input_pipelines.record_files import InputError


def count_records(name: str, compression_type: Optional[str] = None) -> int:
    """Records in one file, read through TensorFlow's reader (which checks
    every record's CRCs: raises tf.errors.DataLossError on a bad one)."""
    ds = tf.data.TFRecordDataset(name, compression_type=compression_type,
                                 buffer_size=8 << 20).batch(4096)
    return int(ds.reduce(tf.constant(0, tf.int64),
                         lambda n, batch: n + tf.size(batch, tf.int64)))


def op_message(error: tf.errors.OpError) -> str:
    """TensorFlow's error text without the function-node and op tags."""
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", error.message.strip())
    return re.sub(r"\s*\[Op:\w+\].*$", "", text.splitlines()[0])


def check_first_record(files: Sequence[str],
                       describe: Callable[[bytes], Optional[str]],
                       compression_type: Optional[str] = None) -> None:
    """Reads one record of the first file and checks it with `describe`
    (`fn(serialized record) -> problem or None`): records of another kind
    or for another model fail here, before training.

    Raises:
        InputError: "FILE: record 0: <problem>", or "FILE: <TF's message>"
            when the file does not read; an empty first file is allowed
            (other files may hold records).
    """
    name = files[0]
    try:
        first = next(iter(tf.data.TFRecordDataset(
            name, compression_type=compression_type).take(1)), None)
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
        raise InputError(
            f"{name}: {op_message(e)}") from None
    if first is None:
        return
    problem = describe(first.numpy())
    if problem:
        raise InputError(f"{name}: record 0: {problem}")


def find_bad_record(files: Sequence[str], parse_fn: Optional[Callable] = None,
                    compression_type: Optional[str] = None,
                    describe: Optional[Callable[[bytes], Optional[str]]] = None
                    ) -> Optional[str]:
    """Scans `files` in order; describes the first unreadable record.

    TensorFlow's errors say "corrupted record at <offset>" or "Key: x ...
    Number of values != expected" without the file. Called after such an
    error, this names it (and, through the parse error, the feature).

    Args:
        files: Record files, in the order to scan.
        parse_fn: The pipeline's batched parse; its errors count as bad.
        compression_type: As in `TFRecordConfig`.
        describe: `fn(serialized record) -> problem or None`, to say what
            is wrong with a record in a batch that failed to parse in words
            the user knows (which flag expects what) rather than TF's.

    Returns:
        "FILE: record N: <problem>" (or "in records N-M: <TF's message>"),
        or None if every record reads and parses.
    """
    for name in files:
        count = 0
        try:
            ds = tf.data.TFRecordDataset(name, compression_type=compression_type)
            for batch in ds.batch(256):
                if parse_fn is not None:
                    try:
                        parse_fn(batch)
                    except tf.errors.InvalidArgumentError:
                        problem = _describe_batch(batch, describe)
                        if problem:
                            index, text = problem
                            return f"{name}: record {count + index}: {text}"
                        raise
                count += int(batch.shape[0])
        except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
            return (f"{name}: in records {count}-{count + 255}: "
                    f"{op_message(e)}")
    return None


def _describe_batch(batch, describe):
    """(index, problem) of the first record `describe` objects to, or None."""
    if describe is None:
        return None
    for index, record in enumerate(batch.numpy()):
        problem = describe(record)
        if problem:
            return index, problem
    return None
