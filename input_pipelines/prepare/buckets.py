"""Stage one of the BERT writer: input files -> documents bucketed by hash.

A corpus that does not fit in one process is written in two stages, each a
set of engine tasks: this one reads one input file (Google's format: one
sentence per line, a blank line between documents; plain or gzip) and puts
each document in bucket `bucket_of(seed, document) mod B` (B = output
shards), so every shard draws its documents from every input file; stage two
(`bert_instances.write_instance_shard`) reads one bucket from every file's
part, at the byte ranges the client hands it, and makes one output shard.

Memory per task is bounded by a setting, not by the input: a file is read in
pieces of about `piece_bytes`, cut at document boundaries (a piece holds
whole documents, so it can exceed the setting by one document: a file
without blank lines is one document, read whole, and said in a warning),
and each
piece's buckets are appended to spill files of this attempt's own; the part
is their concatenation in bucket order. Stage two reads its ranges the same
way, a piece at a time.

A file's part is `part-<file index>.txt` (its documents, grouped by bucket,
in file order within a bucket) and `part-<file index>.json` (each bucket's
byte range and document count), both written under temporary names and
renamed, the JSON last: it is the commit mark, so a part with its JSON is
complete, and a task run twice writes the same bytes. The bytes do not
depend on the piece size.
"""

import dataclasses
import glob
import gzip
import hashlib
import json
import os
import uuid
from typing import Dict, Iterator, List, Sequence, Tuple

from absl import logging

PIECE_BYTES = 16 << 20  # the default piece: --piece_mb=16
COPY_BYTES = 16 << 20   # concatenation: bytes between stop checks
# A piece this many times the setting without a blank line is a document
# held whole in memory: said once per file.
LONG_DOCUMENT_PIECES = 4


def read_documents(lines: Sequence[str]) -> List[List[str]]:
    """Lines -> documents (lists of sentences); blank lines separate them."""
    documents, current = [], []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            documents.append(current)
            current = []
    if current:
        documents.append(current)
    return documents


def bucket_of(seed: int, document: List[str], buckets: int) -> int:
    """A stable bucket (never Python's salted `hash()`)."""
    digest = hashlib.sha256(f"{seed}\0".encode() + "\n".join(
        document).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % buckets


@dataclasses.dataclass(frozen=True)
class SplitTask:
    """One input file to bucket (picklable: it goes to a worker)."""

    path: str
    file_index: int
    buckets: int
    seed: int
    workdir: str
    piece_bytes: int = PIECE_BYTES


def part_paths(workdir: str, file_index: int) -> Tuple[str, str]:
    stem = os.path.join(workdir, f"part-{file_index:05d}")
    return stem + ".txt", stem + ".json"


def read_text(path: str) -> List[str]:
    """The lines of a UTF-8 text file, plain or gzip (all of it: for a
    corpus that fits, such as a vocabulary's sample; see `read_pieces`).

    Raises:
        ValueError: As `read_pieces`.
    """
    return [line for piece in read_pieces(path, 1 << 62) for line in piece]


def read_pieces(path: str, piece_bytes: int) -> Iterator[List[str]]:
    """A UTF-8 text file, plain or gzip, as lists of lines of about
    `piece_bytes` bytes each, cut only at a blank line (a document
    boundary). Lines split as `str.splitlines` splits the whole text.

    Raises:
        ValueError: The bytes are not UTF-8 (naming the file, line and
            byte offset), or the file does not read.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            yield from _pieces(f, piece_bytes, path)
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: {getattr(e, 'strerror', None) or e}"
                         ) from None


def _pieces(raw_lines, piece_bytes: int, path: str) -> Iterator[List[str]]:
    piece: List[str] = []
    size = offset = number = 0
    warned = False
    for raw in raw_lines:
        number += 1
        try:
            piece.extend(raw.decode("utf-8").splitlines())
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: line {number} (byte {offset + e.start})"
                             " is not UTF-8") from None
        offset += len(raw)
        size += len(raw)
        if size >= piece_bytes and not raw.strip():
            yield piece
            piece, size = [], 0
        elif size >= LONG_DOCUMENT_PIECES * piece_bytes and not warned:
            warned = True
            logging.warning(
                "%s: no blank line in the %.1f MiB before byte %d: one "
                "document this long is held whole in memory (Google's format "
                "puts a blank line between documents)", path, size / 2**20,
                offset)
    if piece:
        yield piece


def _document_bytes(documents: Sequence[List[str]]) -> bytes:
    return "".join("\n".join(d) + "\n\n" for d in documents).encode("utf-8")


def split_file(task: SplitTask, progress) -> Dict:
    """Buckets one input file's documents, a piece at a time; returns its
    part's summary ({"documents": [count per bucket], "ranges": [[start,
    end] per bucket]}). A complete part is kept. `progress(0)` is called
    after each piece (where the engine may stop the task)."""
    text_path, json_path = part_paths(task.workdir, task.file_index)
    if os.path.exists(json_path):
        with open(json_path) as f:
            summary = json.load(f)
        progress(1)
        return summary
    attempt = f"{text_path}.{uuid.uuid4().hex}"
    spills = [f"{attempt}.bucket-{b}.incomplete" for b in range(task.buckets)]
    counts = [0] * task.buckets
    try:
        for lines in read_pieces(task.path, task.piece_bytes):
            grouped: List[List[List[str]]] = [[] for _ in range(task.buckets)]
            for document in read_documents(lines):
                grouped[bucket_of(task.seed, document, task.buckets)].append(
                    document)
            for bucket, documents in enumerate(grouped):
                if documents:
                    with open(spills[bucket], "ab") as f:
                        f.write(_document_bytes(documents))
                    counts[bucket] += len(documents)
            progress(0)
        ranges, offset = [], 0
        partial = f"{attempt}.incomplete"
        with open(partial, "wb") as out:
            for spill in spills:
                if os.path.exists(spill):
                    with open(spill, "rb") as f:
                        # A block at a time, asking the engine whether to
                        # stop between blocks (a bucket may be gigabytes).
                        for block in iter(lambda: f.read(COPY_BYTES), b""):
                            out.write(block)
                            progress(0)
                ranges.append([offset, out.tell()])
                offset = out.tell()
        os.replace(partial, text_path)
        summary = {"source": task.path, "ranges": ranges, "documents": counts}
        _write_atomic(json_path, json.dumps(summary).encode())
    finally:
        for leftover in glob.glob(glob.escape(attempt) + ".*incomplete"):
            os.remove(leftover)
    progress(1)
    return summary


def bucket_ranges(parts: Sequence[Dict], bucket: int) -> List[Tuple[int, int, int]]:
    """(file index, start, end) of `bucket` in each part, for stage two's
    task (the client has them from stage one's summaries)."""
    return [(index, *part["ranges"][bucket]) for index, part in enumerate(parts)]


def read_bucket(workdir: str, ranges: Sequence[Tuple[int, int, int]],
                piece_bytes: int = PIECE_BYTES) -> Iterator[List[str]]:
    """A bucket's documents from every part, in file order, read a piece
    of about `piece_bytes` at a time."""
    for index, start, end in ranges:
        text_path, _ = part_paths(workdir, index)
        with open(text_path, "rb") as f:
            f.seek(start)
            lines = iter(lambda: f.readline() if f.tell() < end else b"", b"")
            for piece in _pieces(lines, piece_bytes, text_path):
                yield from read_documents(piece)


def remove_leftovers(workdir: str) -> int:
    """Removes the temporary files of attempts that died (call it when no
    attempt runs). Returns how many."""
    leftovers = glob.glob(os.path.join(glob.escape(workdir), "*.incomplete"))
    for leftover in leftovers:
        os.remove(leftover)
    return len(leftovers)


def _write_atomic(path: str, data: bytes) -> None:
    partial = f"{path}.{uuid.uuid4().hex}.incomplete"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)
