r"""Builds the record indexes the global order reads by, for records written
elsewhere (Google's, NVIDIA's, TF-slim's, tensorflow-datasets').

    python -m input_pipelines.index_records 'gs_copy/wiki/tf_examples.tfrecord*'

For each file, the byte offset of every record goes to
`.tfscale-index/NAME.npy` beside it (8 bytes per record). The project's
writers do this themselves, and a training run indexes files that lack a
fresh index on first use; this command does it ahead of time, once, with a
progress bar, and (unless --noverify) reads every record once through
TensorFlow's reader, which checks each record's CRCs.
"""

import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("verify", True, "Also read every record through "
                  "TensorFlow's reader (checks CRCs).")
flags.DEFINE_bool("force", False, "Rebuild indexes that are fresh.")


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("name the record files: globs or comma lists")
    from cli import quiet_tensorflow
    quiet_tensorflow(FLAGS.verbosity)
    import os

    import tensorflow as tf
    from tqdm import tqdm

    from input_pipelines import tfrecord
    from input_pipelines.record_order import index as record_index
    try:
        files = tfrecord.expand_files(argv[1:])
    except tfrecord.InputError as e:
        sys.exit(f"index_records: error: {e}")
    sizes = [os.path.getsize(f) for f in files]
    records = built = 0
    start = time.perf_counter()
    with tqdm(total=sum(sizes), unit="B", unit_scale=True,
              desc="index_records", file=sys.stderr) as bar:
        for name, size in zip(files, sizes):
            offsets = None if FLAGS.force else record_index.read_saved(name)
            try:
                if offsets is None:
                    offsets = record_index.scan(name)
                    record_index.write(name, offsets)
                    built += 1
                if FLAGS.verify:
                    count = tfrecord.count_records(name)
                    if count != len(offsets) - 1:
                        raise record_index.RecordIndexError(
                            f"{name}: TensorFlow reads {count} records, the "
                            f"index {len(offsets) - 1}")
            except (record_index.RecordIndexError, OSError) as e:
                sys.exit(f"index_records: error: {e}")
            except tf.errors.DataLossError as e:
                sys.exit(f"index_records: error: {name}: "
                         f"{e.message.strip().splitlines()[0]}")
            records += len(offsets) - 1
            bar.update(size)
    seconds = time.perf_counter() - start
    print(f"index_records: {len(files)} files, {records} records "
          f"({built} indexed now, {len(files) - built} already fresh"
          f"{', CRCs checked' if FLAGS.verify else ''}) in {seconds:.1f} s: "
          f"{records / max(seconds, 1e-9) / 1e6:.2f} M records/s")


if __name__ == "__main__":
    app.run(main)
