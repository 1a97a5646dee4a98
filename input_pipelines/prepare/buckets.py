"""Stage one of the BERT writer: input files -> documents bucketed by hash.

A corpus that does not fit in one process is written in two stages, each a
set of engine tasks: this one reads one input file (Google's format: one
sentence per line, a blank line between documents; plain or gzip) and puts
each document in bucket `bucket_of(seed, document) mod B` (B = output
shards), so every shard draws its documents from every input file; stage two
(`bert_instances.write_instance_shard`) reads one bucket from every file's
part and makes one output shard of it. Memory per task: one input file in
stage one, one bucket in stage two; the client only lists files.

A file's part is `part-<file index>.txt` (its documents, grouped by bucket,
in file order within a bucket) and `part-<file index>.json` (each bucket's
byte range and document count), both written under temporary names and
renamed, the JSON last: it is the commit mark, so a part with its JSON is
complete, and a task run twice writes the same bytes.
"""

import dataclasses
import gzip
import hashlib
import json
import os
import uuid
from typing import Dict, List, Sequence, Tuple


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


def part_paths(workdir: str, file_index: int) -> Tuple[str, str]:
    stem = os.path.join(workdir, f"part-{file_index:05d}")
    return stem + ".txt", stem + ".json"


def read_text(path: str) -> List[str]:
    """The lines of a UTF-8 text file, plain or gzip.

    Raises:
        ValueError: The bytes are not UTF-8 (naming the file and offset),
            or the file does not read.
    """
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line} (byte {e.start}) is not UTF-8"
                         ) from None


def split_file(task: SplitTask, progress) -> Dict:
    """Buckets one input file's documents; returns its part's summary
    ({"documents": [count per bucket]}). A complete part is kept."""
    text_path, json_path = part_paths(task.workdir, task.file_index)
    if os.path.exists(json_path):
        with open(json_path) as f:
            summary = json.load(f)
        progress(1)
        return summary
    grouped: List[List[List[str]]] = [[] for _ in range(task.buckets)]
    for document in read_documents(read_text(task.path)):
        grouped[bucket_of(task.seed, document, task.buckets)].append(document)
    ranges, counts, chunks, offset = [], [], [], 0
    for documents in grouped:
        chunk = "".join("\n".join(d) + "\n\n" for d in documents).encode(
            "utf-8")
        ranges.append([offset, offset + len(chunk)])
        counts.append(len(documents))
        chunks.append(chunk)
        offset += len(chunk)
    summary = {"source": task.path, "ranges": ranges, "documents": counts}
    _write_atomic(text_path, b"".join(chunks))
    _write_atomic(json_path, json.dumps(summary).encode())
    progress(1)
    return summary


def read_bucket(workdir: str, files: int, bucket: int) -> List[List[str]]:
    """Bucket `bucket`'s documents from every part, in file order."""
    documents = []
    for index in range(files):
        text_path, json_path = part_paths(workdir, index)
        with open(json_path) as f:
            start, end = json.load(f)["ranges"][bucket]
        with open(text_path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        documents.extend(read_documents(data.decode("utf-8").splitlines()))
    return documents


def _write_atomic(path: str, data: bytes) -> None:
    partial = f"{path}.{uuid.uuid4().hex}.incomplete"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)
