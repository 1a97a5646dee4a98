"""The indexer's task: one record file's index (`index_records`)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class IndexTask:
    """One file to index (picklable: it may go to a worker)."""

    name: str
    force: bool
    verify: bool


def index_file(task: IndexTask, progress) -> tuple:
    """(records, 1 if indexed now else 0) for one file.

    Raises:
        ValueError: The file does not index or verify (one line naming it).
    """
    import os

    import tensorflow as tf

    from input_pipelines import record_checks
    from input_pipelines.record_order import index as record_index
    name = task.name
    offsets = None if task.force else record_index.read_saved(name)
    built = 0
    try:
        if offsets is None:
            offsets = record_index.scan(name)
            record_index.write(name, offsets)
            built = 1
        if task.verify:
            count = record_checks.count_records(name)
            if count != len(offsets) - 1:
                raise record_index.RecordIndexError(
                    f"{name}: TensorFlow reads {count} records, the index "
                    f"{len(offsets) - 1}")
    except OSError as e:
        raise ValueError(f"{name}: {e.strerror or e}") from None
    except tf.errors.DataLossError as e:
        raise ValueError(f"{name}: {e.message.strip().splitlines()[0]}"
                         ) from None
    progress(os.path.getsize(name))
    return len(offsets) - 1, built
