r"""BERT records of realistic size with random tokens, in Google's format:
the input a benchmark or a GPU node check trains on when no corpus is at
hand (no vocabulary, no tensorflow-text).

    python -m input_pipelines.synthetic_bert --output_dir DIR \
        [--num_records 4096] [--num_files 4]

Each record: 64-128 tokens of ids 5-30,000 (BERT's 30,522-word
vocabulary), two segments, 20 masked positions with their ids, a random
next-sentence label; sequence length 128. The same seed writes the same
bytes.
"""

import argparse
import os
import random
import sys

from input_pipelines import bert_records
from input_pipelines.bert_records import BertRecordSpec

SPEC = BertRecordSpec(128, 20)


def write_records(directory: str, num_records: int, num_files: int,
                  seed: int = 0) -> list:
    """Writes `num_records` records round-robin into `num_files` files
    `bert-000.tfrecord`, ... in `directory`; returns their paths."""
    import tensorflow as tf
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    names = [os.path.join(directory, f"bert-{i:03d}.tfrecord")
             for i in range(num_files)]
    writers = [tf.io.TFRecordWriter(n) for n in names]
    for i in range(num_records):
        length = rng.randint(64, 128)
        ids = [rng.randint(5, 30000) for _ in range(length)]
        segments = [0] * (length // 2) + [1] * (length - length // 2)
        positions = sorted(rng.sample(range(1, length), 20))
        writers[i % num_files].write(bert_records.serialize_instance(
            ids, segments, positions, [ids[p] for p in positions],
            rng.random() < 0.5, SPEC))
    for w in writers:
        w.close()
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m input_pipelines.synthetic_bert",
        description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True,
                        help="where the files go (created)")
    parser.add_argument("--num_records", type=int, default=4096,
                        help="records in all (default: 4096)")
    parser.add_argument("--num_files", type=int, default=4,
                        help="files they are spread over (default: 4)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the random tokens' seed (default: 0)")
    args = parser.parse_args(argv)
    if args.num_records < 1 or args.num_files < 1:
        parser.error("--num_records and --num_files must be >= 1")
    os.makedirs(args.output_dir, exist_ok=True)
    names = write_records(args.output_dir, args.num_records, args.num_files,
                          args.seed)
    print(f"{args.num_records} records in {len(names)} files in "
          f"{args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
