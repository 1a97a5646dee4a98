"""Record files: patterns to file names, files to pipelines, and files read
by record number through their offset indexes (`record_order/index.py`).
Errors are `InputError`s naming the pattern or file."""

import os
from typing import Sequence, Union

import tensorflow as tf
from absl import logging

from input_pipelines.record_order import index as record_index
from input_pipelines.record_order.reader import RecordReader


class InputError(ValueError):
    """Input files are missing, empty or malformed; the message names them."""


def expand_files(input_files: Union[str, Sequence[str]]) -> list:
    """Globs and comma lists -> sorted unique file names.

    Raises:
        InputError: A pattern matches no file or a directory (naming it), or
            no pattern was given.
    """
    if isinstance(input_files, str):
        input_files = [input_files]
    patterns = [p.strip() for item in input_files for p in item.split(",")
                if p.strip()]
    if not patterns:
        raise InputError("no input files given")
    files = []
    for pattern in patterns:
        matched = tf.io.gfile.glob(pattern)
        if not matched:
            raise InputError(f"no files match input pattern {pattern!r}")
        # Hidden names are never records: the record indexes
        # (.tfscale-index/) and half-written shards live there.
        matched = [name for name in matched
                   if not os.path.basename(name.rstrip("/")).startswith(".")]
        if not matched:
            raise InputError(f"no files match input pattern {pattern!r}")
        for name in matched:
            if tf.io.gfile.isdir(name):
                raise InputError(
                    f"{name} is a directory, not a record file; name the "
                    f"files, e.g. '{name.rstrip('/')}/*.tfrecord'")
        files.extend(matched)
    return sorted(set(files))


def shard_files(files: Sequence[str], num_pipelines: int, pipeline_id: int):
    """(this pipeline's files, by_file) for one of `num_pipelines` pipelines.

    By file (every pipeline a disjoint subset) when files >= pipelines; else
    all files, to be sharded by record.
    """
    if len(files) >= num_pipelines:
        return list(files[pipeline_id::num_pipelines]), True
    return list(files), False


def open_records(files: Sequence[str]) -> RecordReader:
    """A reader of `files` by record number, indexing any file whose index
    is missing or stale (and saying so, with the command that does it ahead
    of time).

    Raises:
        InputError: A file's frames do not read (naming it), or no records.
    """
    def on_built(built, seconds):
        logging.warning(
            "tfscale: indexed %d record file(s) in %.1f s (%s%s); the "
            "writers and `python -m input_pipelines.index_records` do this "
            "ahead of time", len(built), seconds, built[0],
            ", ..." if len(built) > 1 else "")
    try:
        offsets = record_index.load(files, on_built)
    except (record_index.RecordIndexError, OSError) as e:
        raise InputError(f"bad input record: {e}") from None
    reader = RecordReader(files, offsets)
    if reader.num_records == 0:
        raise InputError(f"no records in {len(files)} file(s) "
                         f"({files[0]}, ...)")
    return reader
