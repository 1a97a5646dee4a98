"""Record files: patterns to file names, files to pipelines, and files read
by record number through their offset indexes (`record_order/index.py`).
Errors are `InputError`s naming the pattern or file."""

import glob
import os
import re
from typing import Optional, Sequence, Union

import tensorflow as tf
from absl import logging

from input_pipelines.record_order import index as record_index
from input_pipelines.record_order.reader import RecordReader


class InputError(ValueError):
    """Input files are missing, empty or malformed; the message names them."""


def expand_files(input_files: Union[str, Sequence[str]],
                 allow_partial_shards: bool = False) -> list:
    """Globs and comma lists -> sorted unique file names.

    Args:
        input_files: Patterns (globs, comma lists).
        allow_partial_shards: Take a glob that matches a shard set
            `NAME-0000i-of-0000N` with some shards missing
            (`missing_shards`); refused otherwise (a file named whole is
            taken as named).

    Raises:
        InputError: A pattern matches no file or a directory (naming it), no
            pattern was given, or a shard set is incomplete (naming the
            missing shards).
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
        # A glob names a set; a name given whole is the user's choice.
        if not allow_partial_shards and glob.has_magic(pattern):
            _refuse_missing(missing_shards(matched))
    return sorted(set(files))


def _refuse_missing(missing: Sequence[str]) -> None:
    if missing:
        raise InputError(
            f"{len(missing)} shard(s) of {os.path.basename(missing[0])}'s set "
            f"are missing: {', '.join(os.path.basename(m) for m in missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''} (a writer that did not "
            "finish?); rerun the writer (it keeps the shards it completed), "
            "or --allow_partial_shards to train on the shards present")


# A shard's name as the writers (and Google's, tfds') write them:
# NAME-00003-of-00008[.EXT].
_SHARD = re.compile(r"^(.*)-(\d+)-of-(\d+)(\.[^/]*)?$")


def missing_shards(files: Sequence[str]) -> list:
    """The shards absent from each `NAME-i-of-N` set some of `files` belong
    to (their would-be paths), in order."""
    sets = {}
    for name in files:
        found = _SHARD.match(name)
        if found:
            stem, index, total, ext = found.groups()
            key = (stem, total, ext or "", len(index))
            sets.setdefault(key, set()).add(int(index))
    missing = []
    for (stem, total, ext, width), present in sorted(sets.items()):
        missing += [f"{stem}-{i:0{width}d}-of-{total}{ext}"
                    for i in range(int(total)) if i not in present]
    return missing


def shard_files(files: Sequence[str], num_pipelines: int, pipeline_id: int):
    """(this pipeline's files, by_file) for one of `num_pipelines` pipelines.

    By file (every pipeline a disjoint subset) when files >= pipelines; else
    all files, to be sharded by record.
    """
    if len(files) >= num_pipelines:
        return list(files[pipeline_id::num_pipelines]), True
    return list(files), False


def open_records(files: Sequence[str],
                 verify_records: bool = True) -> RecordReader:
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
    reader = RecordReader(files, offsets, verify_records=verify_records)
    if reader.num_records == 0:
        raise InputError(f"no records in {len(files)} file(s) "
                         f"({files[0]}, ...)")
    return reader


def reader_error(message: str) -> Optional[str]:
    """The global-order reader's own line inside TensorFlow's error `message`
    (its `RecordIndexError`, raised in the pipeline's read function), or
    None."""
    found = re.search(r"RecordIndexError: ([^\n]*)", message)
    return found.group(1).strip() if found else None
