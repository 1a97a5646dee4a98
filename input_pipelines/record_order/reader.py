"""Records by number, from local TFRecord files and their indexes.

A batch of record numbers becomes one bytes object holding their frames back
to back, plus each frame's length, so the caller cuts it into records with
one vectorized op (`tf.strings.substr`). Each frame is one `os.pread` from
the page cache (random access there is not slower than streaming).

Files are opened as they are needed and kept open in a bounded pool, one
descriptor per file (each read of an open file checks first, with one
fstat, that its size and mtime are still the indexed ones: a file rewritten
in place under the reader is refused, naming it): ImageNet has 1,152 shards and Wikipedia-scale BERT
records thousands, against a soft limit of 1,024 descriptors on many cluster
nodes. When the pool is full the least recently used file is closed, and a
file opened again must be the one the run indexed (the same stamp: inode,
size, mtime and ctime): a file replaced or rewritten during the run is
refused, naming it, instead of yielding other records; one whose ctime
alone moved (a chmod, a hard link: any number of them) is read on when
its content's digest is still the one taken at the start. The pools of all the
readers of a process share one budget (`process_budget`): a pipeline
rebuilt again and again (one per `fit`) leaves readers nobody reads, and
they close their descriptors when another reader needs room. Reads never map the files, so
a file truncated under the reader is a short read and a one-line error, not
a SIGBUS.

Every frame's length field is checked against the index (one vectorized
gather per batch): a file rewritten in place after its index was built fails,
naming the file and record. And every record's CRC-32C is computed over its
bytes as they are read and compared with the CRC its frame stores, as
TensorFlow's own reader does (`verify_records`, on by default): a flipped
bit on a disk, a network filesystem or a copy is one line naming the file
and the record, never a silent wrong result. Data verified once with
`python -m input_pipelines.index_records --verify` may turn it off.
"""

import collections
import os
import resource
import threading
import time
import weakref
from typing import Optional, Sequence, Tuple

import numpy as np

from input_pipelines.record_order import index as record_index
from input_pipelines.record_order.crc import masked_crc32c
from input_pipelines.record_order.index import (FRAME_BYTES, HEADER_BYTES,
                                                RecordIndexError)

# Descriptors left to the rest of the process (sockets, TensorFlow's own
# files) when the pools' sizes come from the limit.
_RESERVED_DESCRIPTORS = 256
_MIN_POOL = 16

# Every reader of this process: their pools share the process's descriptors.
# A pipeline's reader lives as long as the graph of its read function, which
# TensorFlow keeps after the pipeline is dropped (and a pipeline may be
# checkpointed, so its reads stay a stateless function): readers nobody
# reads give their descriptors back when another reader needs them.
_READERS = weakref.WeakSet()


def _soft_limit() -> Optional[int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def default_pool_size(num_files: int) -> int:
    """Descriptors one reader may hold: all its files when the soft
    `RLIMIT_NOFILE` allows (a quarter of what is left after the reserve,
    for the other pipelines of the process), else that quarter."""
    soft = _soft_limit()
    if soft is None:
        return num_files
    share = max(_MIN_POOL, (soft - _RESERVED_DESCRIPTORS) // 4)
    return max(1, min(num_files, share))


def process_budget() -> Optional[int]:
    """Descriptors all the readers of this process hold at most (None: no
    limit): half of what the soft limit leaves after the reserve."""
    soft = _soft_limit()
    if soft is None:
        return None
    return max(_MIN_POOL, (soft - _RESERVED_DESCRIPTORS) // 2)


class RecordReader:
    """Random access to the records of `files`, numbered file after file.

    Args:
        files: Local TFRecord files.
        offsets: Their indexes (`index.load`); each ends with the file's
            size.
        max_open_files: Descriptors held at most (None: `default_pool_size`).
        verify_records: Check every record's CRC-32C as it is read.

    Safe to call from several threads (tf.data may run reads in parallel).
    """

    def __init__(self, files: Sequence[str], offsets: Sequence[np.ndarray],
                 max_open_files: Optional[int] = None,
                 verify_records: bool = True):
        self.files = list(files)
        self.verify_records = verify_records
        counts = np.array([len(o) - 1 for o in offsets], dtype=np.int64)
        # first[f]: number of file f's first record.
        self.first = np.concatenate([[0], np.cumsum(counts)])
        self.num_records = int(self.first[-1])
        # All frame offsets; file f's span is [first[f] + f, first[f+1] + f],
        # its last entry the file's end.
        self._offsets = np.concatenate(list(offsets)) if offsets else (
            np.zeros(0, np.int64))
        self._sizes = [int(o[-1]) for o in offsets]
        self.max_open_files = max(1, max_open_files or
                                  default_pool_size(len(self.files)))
        # One lock for the pool; reads that find every descriptor pinned
        # wait on it for a release rather than open past the bound.
        self._lock = threading.Condition()
        self._open = collections.OrderedDict()  # file id -> fd, LRU first
        self._pins = collections.Counter()      # file id -> reads under way
        self._last_read = time.monotonic()
        _READERS.add(self)
        # Each file's stamp (inode, size, mtime, ctime) now, just after
        # its index was read or made: a file that opens with another one was
        # written or replaced since.
        self._stamps = [record_index.stamp(name) for name in self.files]
        # And its content's digest now (saved beside the index by the
        # writers, index_records and the order; computed here for a
        # read-only folder without one), kept in memory: a file whose
        # ctime alone moves (chmod, a hard link) any number of times is
        # the same file as long as its content is this.
        self._digests = record_index.fingerprints(self.files, offsets)

    def locate(self, record_ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(file index, record number within the file) of each record."""
        record_ids = np.asarray(record_ids, dtype=np.int64)
        file_ids = np.searchsorted(self.first, record_ids, side="right") - 1
        return file_ids, record_ids - self.first[file_ids]

    def read(self, record_ids: np.ndarray) -> Tuple[bytes, np.ndarray]:
        """(the frames of `record_ids` back to back, each frame's length).

        Record i of the batch is `blob[start_i + 12 : start_i + length_i - 4]`
        with `start_i` the sum of the lengths before it.

        Raises:
            RecordIndexError: A frame's length field disagrees with the
                index, or the file is shorter than indexed, or it was
                replaced during the run (the message names it).
            OSError: A file does not open (the message names it).
        """
        record_ids = np.asarray(record_ids, dtype=np.int64)
        file_ids, _ = self.locate(record_ids)
        slot = record_ids + file_ids
        starts, ends = self._offsets[slot], self._offsets[slot + 1]
        lengths = ends - starts
        starts, lengths_list = starts.tolist(), lengths.tolist()
        pieces = [b""] * len(lengths_list)
        # File by file, so that a read pins one descriptor at a time however
        # many files the batch touches.
        order = np.argsort(file_ids, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(file_ids[order])) + 1)
        for group in groups:
            if not len(group):
                continue
            f = int(file_ids[group[0]])
            fd = self._acquire(f)
            try:
                for i in group.tolist():
                    s, n = starts[i], lengths_list[i]
                    piece = os.pread(fd, n, s)
                    if len(piece) != n:
                        raise RecordIndexError(
                            f"{self.files[f]}: ends at byte {s + len(piece)}"
                            f", inside a record its index places at bytes "
                            f"{s}-{s + n} (the file was truncated during the "
                            "run)")
                    pieces[i] = piece
            finally:
                self._release(f)
        blob = b"".join(pieces)
        self._check_lengths(blob, lengths, record_ids)
        if self.verify_records:
            self._check_crcs(blob, lengths, record_ids)
        return blob, lengths

    # ---- the descriptor pool -------------------------------------------------

    def _acquire(self, f: int) -> int:
        """The descriptor of file `f`, pinned until `_release(f)`. With
        every descriptor of a full pool pinned by other reads, waits for
        one to be released: the pool never holds more than its bound (each
        read pins one file at a time, so a wait always ends)."""
        with self._lock:
            while True:
                fd = self._open.get(f)
                if fd is not None:
                    self._check_unchanged(f, fd)
                    self._open.move_to_end(f)
                    break
                self._make_room()
                if len(self._open) < self.max_open_files:
                    _make_room_elsewhere(self)
                    fd = self._open_file(f)
                    self._open[f] = fd
                    break
                self._lock.wait()
            self._pins[f] += 1
            self._last_read = time.monotonic()
            return fd

    def _release(self, f: int) -> None:
        with self._lock:
            self._pins[f] -= 1
            if not self._pins[f]:
                self._lock.notify_all()

    def _make_room(self, wanted: int = 1) -> None:
        """Closes unpinned files, least recently used first, until `wanted`
        more fit (files pinned by reads under way stay open)."""
        for f in list(self._open):
            if len(self._open) + wanted <= self.max_open_files:
                return
            if not self._pins[f]:
                os.close(self._open.pop(f))

    def _open_file(self, f: int) -> int:
        name = self.files[f]
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise OSError(e.errno, f"{name}: {e.strerror}") from None
        info = os.fstat(fd)
        problem = None
        now = record_index.stamp(name, info)
        if info.st_size != self._sizes[f]:
            problem = (f"has {info.st_size} bytes, its index "
                       f"{self._sizes[f]}")
        elif now != self._stamps[f] and not self._same_content(f, now):
            problem = ("is not the file that was indexed (another inode, "
                       "mtime or ctime)")
        if problem:
            os.close(fd)
            raise RecordIndexError(
                f"{name}: {problem} (it was replaced or rewritten during the "
                "run; records cannot change under a run: write new files "
                "and start a run on them)")
        return fd

    def _check_unchanged(self, f: int, fd: int) -> None:
        """A file open since an earlier read is still the one indexed: its
        inode, size and mtime as they were (one fstat a file a batch; a
        rewrite in place moves the mtime, a truncation the size)."""
        info = os.fstat(fd)
        now = record_index.stamp(self.files[f], info)
        if info.st_size < self._sizes[f]:
            raise RecordIndexError(
                f"{self.files[f]}: has {info.st_size} bytes, {self._sizes[f]}"
                " when indexed (the file was truncated during the run)")
        if now.rsplit(":", 1)[0] != self._stamps[f].rsplit(":", 1)[0]:
            raise RecordIndexError(
                f"{self.files[f]}: was rewritten in place during the run "
                "(its size or mtime moved since the reader opened it; "
                "records cannot change under a run: write new files and "
                "start a run on them)")

    def _same_content(self, f: int, now: str) -> bool:
        """Only the ctime of file `f` moved since it was last seen (stamp
        `now`) and its content is the run's: the digest taken when the
        reader was made equals the file's now (then `now` is its stamp)."""
        if now.rsplit(":", 1)[0] != self._stamps[f].rsplit(":", 1)[0]:
            return False  # another inode, size or mtime
        offsets = self._offsets[self.first[f] + f:self.first[f + 1] + f + 1]
        if record_index.fingerprint(self.files[f], offsets) != (
                self._digests[f]):
            return False
        self._stamps[f] = now
        return True

    def _check_lengths(self, blob: bytes, lengths: np.ndarray,
                       record_ids: np.ndarray) -> None:
        if not len(lengths):
            return
        data = np.frombuffer(blob, dtype=np.uint8)
        begins = np.cumsum(lengths) - lengths
        fields = data[begins[:, None] + np.arange(8)].copy().view("<u8")[:, 0]
        bad = np.flatnonzero(fields != (lengths - FRAME_BYTES).astype(np.uint64))
        if len(bad):
            file_id, within = self.locate(record_ids[bad[:1]])
            raise RecordIndexError(
                f"{self.files[int(file_id[0])]}: record {int(within[0])} does "
                "not match the file's record index (the file changed after "
                "it was indexed): rerun python -m input_pipelines."
                f"index_records '{self.files[int(file_id[0])]}'")

    def _check_crcs(self, blob: bytes, lengths: np.ndarray,
                    record_ids: np.ndarray) -> None:
        """Each record's masked CRC-32C against the one its frame stores."""
        if not len(lengths):
            return
        ends = np.cumsum(lengths)
        begins = ends - lengths
        data = np.frombuffer(blob, dtype=np.uint8)
        stored = data[(ends - 4)[:, None] + np.arange(4)].copy().view(
            "<u4")[:, 0]
        computed = masked_crc32c([blob[b + HEADER_BYTES:e - 4] for b, e in
                                  zip(begins.tolist(), ends.tolist())])
        bad = np.flatnonzero(computed != stored)
        if len(bad):
            file_id, within = self.locate(record_ids[bad[:1]])
            name = self.files[int(file_id[0])]
            raise RecordIndexError(
                f"{name}: record {int(within[0])} is corrupt: its CRC-32C "
                f"does not match its bytes (stored {int(stored[bad[0]]):#010x}"
                f", computed {int(computed[bad[0]]):#010x}: a flipped bit on "
                "a disk, a network filesystem or a copy); python -m "
                f"input_pipelines.index_records --verify '{name}' names every "
                "bad record")

    @property
    def last_read(self) -> float:
        """When a read last began (`time.monotonic`)."""
        return self._last_read

    def held(self) -> int:
        """Descriptors held now (read without waiting for the lock)."""
        return len(self._open)

    def give_back(self) -> int:
        """Closes the descriptors no read uses now, unless a read or
        another call holds this reader's lock (never waits: it is called
        by other readers, under their own lock); a read later opens its
        file again. Returns how many it closed."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            closed = 0
            for f in list(self._open):
                if not self._pins[f]:
                    os.close(self._open.pop(f))
                    closed += 1
            self._lock.notify_all()
            return closed
        finally:
            self._lock.release()

    def open_files(self) -> int:
        """Descriptors held now."""
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        """Closes every descriptor once the reads under way have ended (a
        read later opens its file again)."""
        with self._lock:
            while any(self._pins.values()):
                self._lock.wait()
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()


def _make_room_elsewhere(me: RecordReader) -> None:
    """Before `me` opens a file with the process's readers at their budget:
    the other readers, least recently read first, close the descriptors no
    read of theirs uses (a reader busy now is skipped, never waited for)."""
    budget = process_budget()
    if budget is None:
        return
    readers = list(_READERS)
    held = sum(r.held() for r in readers)
    for reader in sorted((r for r in readers if r is not me),
                         key=lambda r: r.last_read):
        if held < budget:
            return
        held -= reader.give_back()


def split_offsets(lengths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(start of each record's payload in the blob, its length)."""
    begins = np.cumsum(lengths) - lengths
    return begins + HEADER_BYTES, lengths - FRAME_BYTES
