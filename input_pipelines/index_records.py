r"""Builds the record indexes the global order reads by, for records written
elsewhere (Google's, NVIDIA's, TF-slim's, tensorflow-datasets').

    python -m input_pipelines.index_records 'gs_copy/wiki/tf_examples.tfrecord*'

For each file, the byte offset of every record goes to
`.tfscale-index/NAME.index.npz` beside it (8 bytes per record, with the
file's stamp: inode, size, mtime, ctime). The project's
writers do this themselves, and a training run indexes files that lack a
fresh index on first use; this command does it ahead of time, once, with a
progress bar, and (unless --noverify) reads every record once through
TensorFlow's reader, which checks each record's CRCs. One task per file, in
this process, --num_processes local processes or on a Dask scheduler's
workers (--scheduler, --scheduler_file; `input_pipelines/prepare`).
"""

import time

from absl import app, flags

from input_pipelines.prepare import engine, indexing
from tfscale.cli import usage_error

FLAGS = flags.FLAGS
flags.DEFINE_bool("verify", True, "Also read every record through "
                  "TensorFlow's reader (checks CRCs).")
flags.DEFINE_bool("force", False, "Rebuild indexes that are fresh.")
flags.DEFINE_integer("num_processes", 1, "Indexing processes (0: one per "
                     "core, for many large files).")
engine.define_flags(flags)

BYTES_PER_PROCESS = 4 << 30  # a process imports TensorFlow: a few seconds


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("name the record files: globs or comma lists")
    from tfscale.cli import quiet_tensorflow
    quiet_tensorflow(FLAGS.verbosity)
    import os

    from input_pipelines import record_files
    try:
        files = record_files.expand_files(argv[1:],
                                             allow_partial_shards=True)
        config = engine.config_from_flags(FLAGS, FLAGS.num_processes)
    except ValueError as e:
        usage_error("index_records", f"{e}")
    sizes = [os.path.getsize(f) for f in files]
    start = time.perf_counter()
    try:
        results = engine.run(
            [indexing.IndexTask(f, FLAGS.force, FLAGS.verify)
             for f in files],
            indexing.index_file, config=config, work=sizes,
            work_per_process=BYTES_PER_PROCESS, describe=lambda t: t.name,
            unit="byte", show_progress=True)
    except (ValueError, engine.TaskError) as e:
        usage_error("index_records", f"{e}")
    records = sum(r[0] for r in results)
    built = sum(r[1] for r in results)
    seconds = time.perf_counter() - start
    print(f"index_records: {len(files)} files, {records} records "
          f"({built} indexed now, {len(files) - built} already fresh"
          f"{', CRCs checked' if FLAGS.verify else ''}) in {seconds:.1f} s: "
          f"{records / max(seconds, 1e-9) / 1e6:.2f} M records/s")


def run():
    """The console script."""
    from tfscale.cli import run_main
    run_main("index_records", main)


if __name__ == "__main__":
    run()
