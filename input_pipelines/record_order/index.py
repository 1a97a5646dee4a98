"""Per-file record offsets, stored beside the shards.

A TFRecord file is a run of framed records: an 8-byte little-endian length,
4 bytes of CRC, the record, 4 bytes of CRC. The index of `DIR/NAME` is
`DIR/.tfscale-index/NAME.index.npz`: `offsets`, the int64 byte offset of
every record's frame and, last, the file's size (8 bytes per record on disk),
and `stamp`, the file's `stamp` when it was indexed (a hidden folder, so
globs such as `DIR/*` never read it as records). Scanning the frames of a
file costs one small read per record, about 1 s per million records from
the page cache (0.76-0.96 s in benchmarks/pipelines/input_pipeline.py).

A file's stamp is its inode, size, mtime_ns and ctime_ns: what changes when
a file is written, or replaced by another file (`mv` or `rsync -a` of a copy
written earlier, `cp -p`, `tar x`: the inode or the ctime, which no tool
sets back, changes even when the mtime is set to an older time). An index
is stale when the stamp differs, or the frames at its first and last
offsets do not hold the lengths it implies: `load` then rebuilds it (and
says so).

Beside the index, `NAME.fingerprint` holds a digest of the file's content:
its size, its offsets and every record's CRC (the last 4 bytes of each
frame, which TFRecord writers compute over the record's bytes), after the
stamp it was computed for. Records rewritten with the same lengths and
counts change it; the same file under another name does not. It is
computed from the index with one 4-byte read per record and saved, so an
order's identity costs one small read per file (`fingerprints`).
"""

import hashlib
import mmap
import os
import struct
import time
import uuid
from typing import Callable, List, Optional, Sequence

import numpy as np

INDEX_DIR = ".tfscale-index"
FRAME_BYTES = 16  # length (8) + its CRC (4) + the record's CRC (4)
HEADER_BYTES = 12


class RecordIndexError(ValueError):
    """A record file's frames do not read; the message names the file."""


def index_path(record_file: str) -> str:
    directory, name = os.path.split(os.path.abspath(record_file))
    return os.path.join(directory, INDEX_DIR, name + ".index.npz")


def stamp(path: str, info: Optional[os.stat_result] = None) -> str:
    """What changes whenever the file at `path` is written or replaced:
    its inode, size, mtime and ctime (ns). `info`: its `os.stat`, if
    taken."""
    info = info or os.stat(path)
    return (f"{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:"
            f"{info.st_ctime_ns}")


def scan(record_file: str) -> np.ndarray:
    """Offsets of every record's frame in `record_file`, then its size.

    Raises:
        RecordIndexError: A frame claims more bytes than the file holds (a
            truncated file, or not a TFRecord file).
    """
    size = os.path.getsize(record_file)
    offsets = []
    if size:
        with open(record_file, "rb") as f, mmap.mmap(
                f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            unpack = struct.Struct("<Q").unpack_from
            position = 0
            while position < size:
                if position + FRAME_BYTES > size:
                    raise RecordIndexError(
                        f"{record_file}: {size - position} stray bytes after "
                        f"record {len(offsets)} (a truncated or non-TFRecord "
                        "file)")
                offsets.append(position)
                position += unpack(data, position)[0] + FRAME_BYTES
            if position != size:
                raise RecordIndexError(
                    f"{record_file}: record {len(offsets) - 1} at byte "
                    f"{offsets[-1]} runs past the end of the file ({size} "
                    "bytes): truncated, or not a TFRecord file (compressed "
                    "records cannot be indexed)")
    offsets.append(size)
    return np.asarray(offsets, dtype=np.int64)


def write(record_file: str, offsets: Optional[np.ndarray] = None) -> str:
    """Scans `record_file` (unless `offsets` are given) and writes its index
    atomically, under the stamp the file had before the scan (a file
    written during the scan is indexed again next time), and its content's
    digest (`fingerprints`); returns the index's path."""
    before = stamp(record_file)
    if offsets is None:
        offsets = scan(record_file)
    path = index_path(record_file)
    _make_index_dir(os.path.dirname(path))
    # A name of this attempt's own: two writers of one index (two hosts
    # may share a pid) never write into each other's file.
    partial = f"{path}.{uuid.uuid4().hex}.partial"
    try:
        with open(partial, "wb") as f:
            np.savez(f, offsets=np.asarray(offsets, np.int64),
                     stamp=np.asarray(before))
        os.replace(partial, path)
    except BaseException:
        _remove(partial)
        raise
    # And the content's digest, so that a data set indexed ahead of time and
    # read from a read-only mount has it (`RecordReader` compares a file
    # whose ctime alone moved against it).
    fingerprints([record_file], [np.asarray(offsets, np.int64)])
    return path


def _make_index_dir(directory: str) -> None:
    """The index folder; in a folder other users may write in, one they may
    write in too (their writers and readers index files there as well)."""
    if os.path.isdir(directory):
        return
    os.makedirs(directory, exist_ok=True)
    parent = os.stat(os.path.dirname(directory)).st_mode
    if parent & 0o022:
        os.chmod(directory, parent & 0o7777)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _fresh(record_file: str, offsets: np.ndarray, saved_stamp: str) -> bool:
    """The index matches the file: its stamp, size, and the first and last
    frames."""
    if offsets.ndim != 1 or len(offsets) < 1:
        return False
    info = os.stat(record_file)
    if saved_stamp != stamp(record_file, info):
        return False
    size = info.st_size
    if int(offsets[-1]) != size:
        return False
    if len(offsets) == 1:
        return size == 0
    with open(record_file, "rb") as f:
        for i in (0, len(offsets) - 2):
            f.seek(int(offsets[i]))
            header = f.read(8)
            if len(header) < 8 or struct.unpack("<Q", header)[0] != int(
                    offsets[i + 1] - offsets[i] - FRAME_BYTES):
                return False
    return True


def read_saved(record_file: str) -> Optional[np.ndarray]:
    """The saved index of `record_file` if it is there and fresh, else None."""
    try:
        with np.load(index_path(record_file), allow_pickle=False) as saved:
            offsets, saved_stamp = saved["offsets"], str(saved["stamp"])
    except (OSError, ValueError, KeyError):
        return None  # none, from an older tfscale, or unreadable
    return offsets if _fresh(record_file, offsets, saved_stamp) else None


def fingerprint_path(record_file: str) -> str:
    return index_path(record_file)[:-len(".index.npz")] + ".fingerprint"


def fingerprint(record_file: str, offsets: np.ndarray) -> str:
    """The digest of a file's content from its fresh index: its size and
    offsets, and every record's CRC (read, 4 bytes a record)."""
    digest = hashlib.sha256(np.asarray(offsets, np.int64).tobytes())
    if len(offsets) > 1:
        with open(record_file, "rb") as f, mmap.mmap(
                f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            view = np.frombuffer(data, np.uint8)
            positions = (np.asarray(offsets[1:], np.int64) - 4)[:, None]
            digest.update(view[positions + np.arange(4)].tobytes())
            del view
    return digest.hexdigest()


def fingerprints(record_files: Sequence[str],
                 offsets: Sequence[np.ndarray]) -> List[str]:
    """Each file's content digest (`fingerprint`): the saved one when it was
    computed for the file's present stamp, else computed now and saved when
    the folder is writable. `offsets`: from `load`."""
    result = []
    for name, file_offsets in zip(record_files, offsets):
        path = fingerprint_path(name)
        now = stamp(name)
        try:
            with open(path) as f:
                saved = f.read().split()
        except OSError:
            saved = []
        if len(saved) == 2 and saved[0] == now:
            result.append(saved[1])
            continue
        value = fingerprint(name, file_offsets)
        if stamp(name) == now:  # not written while it was read
            partial = f"{path}.{uuid.uuid4().hex}.partial"
            try:
                with open(partial, "w") as f:
                    f.write(f"{now} {value}\n")
                os.replace(partial, path)
            except OSError:
                _remove(partial)  # a read-only folder: computed next time
        result.append(value)
    return result


def load(record_files: Sequence[str],
         on_built: Optional[Callable[[List[str], float], None]] = None
         ) -> List[np.ndarray]:
    """The offsets of each file: saved ones when fresh; missing or stale ones
    are scanned now and saved when the folder is writable.

    Args:
        record_files: Local TFRecord files (uncompressed).
        on_built: `fn(files indexed now, seconds)`, called once if any were.

    Raises:
        RecordIndexError: A file's frames do not read (naming it).
    """
    result, built = [], []
    start = time.perf_counter()
    for name in record_files:
        offsets = read_saved(name)
        if offsets is None:
            offsets = scan(name)
            built.append(name)
            try:
                write(name, offsets)
            except OSError:
                pass  # a read-only folder: the index lives in memory only
        result.append(offsets)
    if built and on_built:
        on_built(built, time.perf_counter() - start)
    return result
