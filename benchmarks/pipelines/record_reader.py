r"""What reading records by number costs: the reader, and the whole pipeline.

    python -m benchmarks.pipelines.record_reader [--files 16] [--records_per_file 8192] \
        [--repeats 3]

On generated BERT-sized records (900 bytes) in the page cache, in one run,
interleaved rounds, medians:
  reader      `RecordReader.read` of random batches of 256 record numbers:
              pread with every file open (the default when the descriptor
              limit allows), pread with a pool of 4 descriptors (files
              closed and reopened as batches move on), and a memory-mapped
              baseline (slicing an mmap per file, the reader before it had
              to bound its descriptors and survive truncated files)
  pipeline    `tfrecord.make_dataset` in the global order with BERT parsing
              (examples/s), with the pread reader and with the mmap baseline
              swapped in: what the reader's cost is worth end to end
Results go in benchmarks/README.md ("Reading records by number").
"""

import argparse
import mmap
import statistics
import tempfile
import time
from unittest import mock

import numpy as np

from benchmarks import harness
from input_pipelines import bert_records, record_files, tfrecord
from input_pipelines.record_order import index as record_index
from input_pipelines.record_order import reader as reader_lib
from input_pipelines.synthetic_bert import SPEC, write_records

BATCH = 256


class MmapReader(reader_lib.RecordReader):
    """The baseline: every file memory-mapped, frames sliced from the maps
    (two descriptors per file; a file truncated under it is a SIGBUS)."""

    def __init__(self, files, offsets, max_open_files=None,
                 verify_records=False):
        super().__init__(files, offsets, verify_records=verify_records)
        self._handles = [open(name, "rb") for name in files]
        self._maps = [mmap.mmap(h.fileno(), 0, access=mmap.ACCESS_READ)
                      for h in self._handles]

    def read(self, record_ids):
        record_ids = np.asarray(record_ids, dtype=np.int64)
        file_ids, _ = self.locate(record_ids)
        slot = record_ids + file_ids
        starts, ends = self._offsets[slot], self._offsets[slot + 1]
        maps = self._maps
        blob = b"".join([maps[f][s:e] for f, s, e in zip(
            file_ids.tolist(), starts.tolist(), ends.tolist())])
        lengths = ends - starts
        self._check_lengths(blob, lengths, record_ids)
        return blob, lengths

    def close(self):
        for m in self._maps:
            m.close()
        for h in self._handles:
            h.close()


def reader_rate(make, files, offsets, batches) -> float:
    reader = make(files, offsets)
    reader.read(batches[0])
    start = time.perf_counter()
    for batch in batches:
        reader.read(batch)
    seconds = time.perf_counter() - start
    reader.close()
    return len(batches) * BATCH / seconds


def pipeline_rate(files, reader_class, batches: int) -> float:
    # CRCs off for both readers: what is timed is the reading by number.
    config = tfrecord.TFRecordConfig(files, seed=1, verify_records=False)
    parse = bert_records.make_parse_fn(SPEC)
    with mock.patch.object(record_files, "RecordReader", reader_class):
        ds = tfrecord.make_dataset(config, BATCH, parse)
        iterator = iter(ds)
        for _ in range(5):
            next(iterator)
        start = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        return batches * BATCH / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=16,
                        help="record files written")
    parser.add_argument("--records_per_file", type=int, default=8192,
                        help="records in each file")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each measurement is repeated")
    parser.add_argument("--pipeline_batches", type=int, default=300,
                        help="batches read through the whole pipeline")
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="tfscale-reader-")
    files = write_records(directory, args.files * args.records_per_file,
                          args.files)
    for name in files:
        record_index.write(name)
    offsets = record_index.load(files)
    total = args.files * args.records_per_file
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, total, BATCH) for _ in range(400)]
    readers = {
        "pread, every file open": reader_lib.RecordReader,
        "pread, pool of 4 descriptors":
            lambda f, o: reader_lib.RecordReader(f, o, max_open_files=4),
        "mmap baseline": MmapReader}
    pipelines = {"pread": reader_lib.RecordReader, "mmap baseline": MmapReader}
    rates = {name: [] for name in [*readers, *(f"pipeline, {p}"
                                               for p in pipelines)]}
    for _ in range(args.repeats):
        for name, make in readers.items():
            rates[name].append(reader_rate(make, files, offsets, batches))
        for name, cls in pipelines.items():
            rates[f"pipeline, {name}"].append(
                pipeline_rate(files, cls, args.pipeline_batches))
    base = statistics.median(rates["mmap baseline"])
    pipe_base = statistics.median(rates["pipeline, mmap baseline"])
    print(f"{total} records of ~900 bytes in {args.files} files, batches of "
          f"{BATCH}, medians of {args.repeats} rounds")
    table = harness.Table(["what", "records/s", "vs mmap baseline"])
    for name, values in rates.items():
        reference = pipe_base if name.startswith("pipeline") else base
        median = statistics.median(values)
        table.row(name, f"{median:,.0f}", f"{median / reference:.2f}")


if __name__ == "__main__":
    main()
